-- E2B egress rules (network.allowOut / denyOut) as the user gave them, checked: IPv4 CIDRs
-- (and IPv6 in deny_out), comma-separated, '' = none. What the node's switch gets is derived
-- from these and `internet` (cube-master's egress.rs).
ALTER TABLE sandboxes ADD COLUMN allow_out TEXT NOT NULL DEFAULT '';
ALTER TABLE sandboxes ADD COLUMN deny_out TEXT NOT NULL DEFAULT '';
