-- Snapshots of sandboxes. A snapshot is a template build on the node that took it, named by
-- the snapshot id, so creating a sandbox from it must go to that node.
CREATE TABLE snapshots (
    id            TEXT PRIMARY KEY,
    name          TEXT NOT NULL DEFAULT '',
    team_id       TEXT NOT NULL,
    sandbox_id    TEXT NOT NULL,
    node_id       TEXT NOT NULL,
    template      TEXT NOT NULL,
    build         TEXT NOT NULL DEFAULT '',
    filesystem_only BIGINT NOT NULL DEFAULT 1,
    created_at_ms BIGINT NOT NULL
);
CREATE INDEX snapshots_team ON snapshots (team_id, created_at_ms);
CREATE INDEX snapshots_name ON snapshots (team_id, name);
