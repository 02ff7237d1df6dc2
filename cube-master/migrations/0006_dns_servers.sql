-- E2B network.dnsServers as the user gave them, checked (cube-master's egress.rs): IPv4
-- addresses, comma-separated; NULL = not given (the node's resolver serves allowOut's domain
-- names), '' = an empty list (no DNS at all).
ALTER TABLE sandboxes ADD COLUMN dns_servers TEXT;
