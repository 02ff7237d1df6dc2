-- Nodes and join tokens (portable SQL, like 0001). Live health (last heartbeat, sandbox count,
-- templates) is kept in the master's memory; the row holds what must survive a restart:
-- identity, address, the node secret's hash and the cordon flag.
CREATE TABLE nodes (
    node_id          TEXT PRIMARY KEY,
    address          TEXT NOT NULL,
    -- static (from the master config) | registered
    origin           TEXT NOT NULL,
    secret_sha256    TEXT NOT NULL DEFAULT '',
    cordoned         BIGINT NOT NULL DEFAULT 0,
    version          TEXT NOT NULL DEFAULT '',
    runtime          TEXT NOT NULL DEFAULT '',
    kvm_kind         TEXT NOT NULL DEFAULT '',
    vcpus            BIGINT NOT NULL DEFAULT 0,
    memory_mib       BIGINT NOT NULL DEFAULT 0,
    max_sandboxes    BIGINT NOT NULL DEFAULT 0,
    registered_at_ms BIGINT NOT NULL,
    last_seen_ms     BIGINT NOT NULL DEFAULT 0
);

-- One-time join tokens, stored only as their SHA-256. used_at_ms = 0 while unused.
CREATE TABLE join_tokens (
    token_sha256  TEXT PRIMARY KEY,
    created_at_ms BIGINT NOT NULL,
    expires_at_ms BIGINT NOT NULL,
    used_at_ms    BIGINT NOT NULL DEFAULT 0,
    used_by       TEXT NOT NULL DEFAULT ''
);

CREATE INDEX sandboxes_node ON sandboxes (node_id, state);
