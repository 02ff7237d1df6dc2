-- E2B lifecycle and edge settings (portable SQL, like 0001): what a sandbox does at its
-- timeout, whether traffic resumes it, its create timeout (a resume by traffic gives it that
-- again), whether it may reach the internet (-1: created before this was recorded), whether
-- its ports need the traffic access token (allowPublicTraffic false) and the Host header the
-- edge sends it (maskRequestHost; '' = the client's).
ALTER TABLE sandboxes ADD COLUMN auto_pause BIGINT NOT NULL DEFAULT 0;
ALTER TABLE sandboxes ADD COLUMN auto_resume BIGINT NOT NULL DEFAULT 0;
ALTER TABLE sandboxes ADD COLUMN timeout_s BIGINT NOT NULL DEFAULT 0;
ALTER TABLE sandboxes ADD COLUMN internet BIGINT NOT NULL DEFAULT -1;
ALTER TABLE sandboxes ADD COLUMN private_ports BIGINT NOT NULL DEFAULT 0;
ALTER TABLE sandboxes ADD COLUMN mask_request_host TEXT NOT NULL DEFAULT '';

-- A create's Idempotency-Key, per team: the first create with a key claims it (the primary
-- key makes the claim atomic across masters sharing the database) and names its sandbox;
-- a retry finds the row and answers with that sandbox. `fingerprint` is a hash of the
-- request, so the same key with a different request is refused.
CREATE TABLE idempotency_keys (
    team_id       TEXT NOT NULL,
    idem_key      TEXT NOT NULL,
    sandbox_id    TEXT NOT NULL,
    fingerprint   TEXT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    PRIMARY KEY (team_id, idem_key)
);
CREATE INDEX idempotency_keys_created ON idempotency_keys (created_at_ms);
