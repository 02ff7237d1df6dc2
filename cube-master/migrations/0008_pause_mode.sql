-- What a pause kept (portable SQL, like 0001): '' while not paused, 'full' (memory and
-- filesystem) or 'filesystem' (E2B's pause with memory: false: the sandbox restarts from its
-- disk on resume); and whether the pause at the timeout keeps only the filesystem
-- (autoPauseMemory false).
ALTER TABLE sandboxes ADD COLUMN pause_mode TEXT NOT NULL DEFAULT '';
ALTER TABLE sandboxes ADD COLUMN auto_pause_filesystem BIGINT NOT NULL DEFAULT 0;
