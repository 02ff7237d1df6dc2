//! Generates the gRPC code with `protoc` (Debian `protobuf-compiler`); `PROTOC` overrides the path.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/cube/node/v1/node.proto",
        "proto/cube/master/v1/master.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    tonic_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(&protos, &["proto"])?;
    Ok(())
}
