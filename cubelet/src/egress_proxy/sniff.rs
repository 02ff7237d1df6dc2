//! The name a client asks for in the first bytes of a connection: the SNI of a TLS
//! ClientHello (rustls' acceptor parses it) or the Host of an HTTP/1 request (httparse).

/// What the bytes so far say.
#[derive(Debug, PartialEq, Eq)]
pub enum Sniffed {
    Name(String),
    /// Neither TLS with an SNI nor HTTP with a Host: refused.
    NoName,
    /// Not enough bytes yet.
    More,
}

/// Classifies the first bytes of a connection.
pub fn server_name(buf: &[u8]) -> Sniffed {
    match buf.first() {
        None => Sniffed::More,
        // A TLS handshake record.
        Some(0x16) => tls(buf),
        Some(_) => http(buf),
    }
}

fn tls(buf: &[u8]) -> Sniffed {
    let mut acc = rustls::server::Acceptor::default();
    let mut rd = buf;
    while !rd.is_empty() {
        match acc.read_tls(&mut rd) {
            Ok(0) => break,
            Ok(_) => {}
            Err(_) => return Sniffed::NoName,
        }
    }
    match acc.accept() {
        Ok(Some(hello)) => match hello.client_hello().server_name() {
            Some(n) => Sniffed::Name(n.to_string()),
            None => Sniffed::NoName,
        },
        Ok(None) => Sniffed::More,
        Err(_) => Sniffed::NoName,
    }
}

fn http(buf: &[u8]) -> Sniffed {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Sniffed::More,
        Err(_) => return Sniffed::NoName,
    }
    let mut hosts = req
        .headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("host"));
    let (Some(h), None) = (hosts.next(), hosts.next()) else {
        return Sniffed::NoName; // none, or two (which one would the server believe?)
    };
    let Ok(v) = std::str::from_utf8(h.value) else {
        return Sniffed::NoName;
    };
    let v = v.trim();
    // "name:port"; a bracketed IPv6 literal is no name.
    let name = match v.rsplit_once(':') {
        Some((n, p)) if p.bytes().all(|b| b.is_ascii_digit()) => n,
        Some(_) => return Sniffed::NoName,
        None => v,
    };
    Sniffed::Name(name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_host() {
        let r = |s: &str| server_name(s.as_bytes());
        assert_eq!(
            r("GET / HTTP/1.1\r\nHost: Api.Example.com:8080\r\n\r\n"),
            Sniffed::Name("Api.Example.com".into())
        );
        assert_eq!(r("GET / HTTP/1.1\r\nHost: a.b\r\n"), Sniffed::More);
        assert_eq!(r("GET / HTTP/1.0\r\n\r\n"), Sniffed::NoName);
        assert_eq!(
            r("GET / HTTP/1.1\r\nHost: a.com\r\nHost: b.com\r\n\r\n"),
            Sniffed::NoName
        );
        assert_eq!(r("SSH-2.0-OpenSSH_9.2\r\n"), Sniffed::NoName);
        assert_eq!(r(""), Sniffed::More);
    }

    #[test]
    fn tls_sni() {
        // A TLS 1.2 ClientHello for "a.cube.test": record, handshake header, version, random,
        // no session, one suite, null compression, extensions signature_algorithms (rustls
        // requires it, as every real client sends it) and server_name.
        let name = b"a.cube.test";
        let mut sni = vec![0x00, 0x0d, 0x00, 0x04, 0x00, 0x02, 0x04, 0x03];
        sni.extend([0x00, 0x00]); // extension type server_name
        let list_len = 3 + name.len();
        sni.extend((list_len as u16 + 2).to_be_bytes());
        sni.extend((list_len as u16).to_be_bytes());
        sni.push(0);
        sni.extend((name.len() as u16).to_be_bytes());
        sni.extend(name);
        let mut body = vec![0x03, 0x03];
        body.extend([7u8; 32]);
        body.push(0);
        body.extend([0x00, 0x02, 0xc0, 0x2f, 0x01, 0x00]);
        body.extend((sni.len() as u16).to_be_bytes());
        body.extend(&sni);
        let mut hs = vec![0x01, 0x00];
        hs.extend((body.len() as u16).to_be_bytes());
        hs.extend(&body);
        let mut rec = vec![0x16, 0x03, 0x01];
        rec.extend((hs.len() as u16).to_be_bytes());
        rec.extend(&hs);
        assert_eq!(server_name(&rec), Sniffed::Name("a.cube.test".into()));
        assert_eq!(server_name(&rec[..rec.len() - 3]), Sniffed::More);
        assert_eq!(server_name(&[0x16, 0xff, 0xff, 0, 1, 0]), Sniffed::NoName);
    }
}
