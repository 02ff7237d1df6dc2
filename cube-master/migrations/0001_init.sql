-- Portable SQL (SQLite and PostgreSQL): text ids, BIGINT unix milliseconds, JSON as TEXT.
CREATE TABLE sandboxes (
    id             TEXT PRIMARY KEY,
    team_id        TEXT NOT NULL,
    template       TEXT NOT NULL,
    build          TEXT NOT NULL DEFAULT '',
    state          TEXT NOT NULL,
    reason         TEXT NOT NULL DEFAULT '',
    node_id        TEXT NOT NULL DEFAULT '',
    agent_address  TEXT NOT NULL DEFAULT '',
    host_interface TEXT NOT NULL DEFAULT '',
    access_token   TEXT NOT NULL,
    envd_version   TEXT NOT NULL DEFAULT '',
    metadata       TEXT NOT NULL DEFAULT '{}',
    vcpus          BIGINT NOT NULL DEFAULT 0,
    memory_mib     BIGINT NOT NULL DEFAULT 0,
    disk_mib       BIGINT NOT NULL DEFAULT 0,
    runtime        TEXT NOT NULL DEFAULT '',
    started_at_ms  BIGINT NOT NULL,
    end_at_ms      BIGINT NOT NULL,
    updated_at_ms  BIGINT NOT NULL
);
CREATE INDEX sandboxes_state ON sandboxes (state, end_at_ms);
CREATE INDEX sandboxes_team ON sandboxes (team_id, started_at_ms);
CREATE UNIQUE INDEX sandboxes_token ON sandboxes (access_token);

CREATE TABLE api_keys (
    id            TEXT PRIMARY KEY,
    name          TEXT NOT NULL,
    team_id       TEXT NOT NULL,
    key_sha256    TEXT NOT NULL UNIQUE,
    prefix        TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    revoked       BIGINT NOT NULL DEFAULT 0
);
