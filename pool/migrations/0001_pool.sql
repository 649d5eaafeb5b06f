-- The pool's schema, one for SQLite and PostgreSQL: TEXT ids (UUIDs), BIGINT times in
-- ms since the Unix epoch, BIGINT counters, comma-separated upper-case lists.

CREATE TABLE signing_keys (
    id TEXT PRIMARY KEY,
    seed TEXT NOT NULL,
    created_ms BIGINT NOT NULL
);

CREATE TABLE providers (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    fabric_address TEXT NOT NULL,
    transports TEXT NOT NULL,
    heartbeat_ttl_ms BIGINT NOT NULL,
    last_heartbeat_ms BIGINT NOT NULL,
    generation BIGINT NOT NULL,
    created_ms BIGINT NOT NULL
);

CREATE TABLE devices (
    id TEXT PRIMARY KEY,
    provider_id TEXT NOT NULL REFERENCES providers (id),
    name TEXT NOT NULL,
    resource_class TEXT NOT NULL,
    capacity_bytes BIGINT NOT NULL,
    traits TEXT NOT NULL,
    -- 1 while the provider's last registration lists the device; 0 for a leased device
    -- it no longer lists (kept until the lease ends).
    listed BIGINT NOT NULL,
    -- The lease that claimed the device last; it holds the device only while that
    -- lease is claimed or bound and not expired.
    lease_id TEXT,
    generation BIGINT NOT NULL,
    UNIQUE (provider_id, name)
);

-- Leases copy the names and address they were granted with, so that the history
-- outlives a device's removal.
CREATE TABLE leases (
    id TEXT PRIMARY KEY,
    device_id TEXT NOT NULL,
    device_name TEXT NOT NULL,
    provider_id TEXT NOT NULL,
    provider_name TEXT NOT NULL,
    fabric_address TEXT NOT NULL,
    consumer TEXT NOT NULL,
    compute_host TEXT NOT NULL,
    state TEXT NOT NULL,
    created_ms BIGINT NOT NULL,
    expires_at_ms BIGINT NOT NULL,
    ttl_ms BIGINT NOT NULL,
    generation BIGINT NOT NULL
);

CREATE INDEX leases_by_state ON leases (state, expires_at_ms);
CREATE INDEX leases_by_provider ON leases (provider_id, state);
