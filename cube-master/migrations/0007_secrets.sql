-- E2B secrets: one row per secret with its current version's value sealed (AES-256-GCM under
-- the master's secrets key, bound to team, id and version; cube-master's secrets.rs), never
-- the value itself. Names are canonical (lower-cased) and unique in their team.
CREATE TABLE secrets (
    id            TEXT PRIMARY KEY,
    team_id       TEXT NOT NULL,
    name          TEXT NOT NULL,
    version       BIGINT NOT NULL,
    metadata      TEXT NOT NULL DEFAULT '',
    sealed        TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    UNIQUE (team_id, name)
);
CREATE INDEX secrets_team ON secrets (team_id, created_at_ms, id);
