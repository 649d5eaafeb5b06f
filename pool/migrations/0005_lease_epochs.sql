-- Fencing epochs: every lease granted takes the next number of one counter that only
-- grows, and its token carries it. A lender that has seen a device's lease of epoch E
-- never serves that device to a lease below E again, even while it cannot reach the
-- pool. Leases granted before this migration have epoch 0.
ALTER TABLE leases ADD COLUMN epoch BIGINT NOT NULL DEFAULT 0;
-- The epoch of the last lease granted on the device (0: none since this migration).
ALTER TABLE devices ADD COLUMN last_epoch BIGINT NOT NULL DEFAULT 0;
CREATE TABLE lease_epochs (
    id TEXT PRIMARY KEY,
    last BIGINT NOT NULL
);
INSERT INTO lease_epochs (id, last) VALUES ('default', 0);
-- When a pool server last looked at the database (ms since the epoch, the pool's
-- clock). A gap longer than the absence threshold means no pool server was there to
-- take renewals (all stopped, stalled, or the database down): the leases live when it
-- last looked then get a full TTL from its return before any of them can expire.
CREATE TABLE pool_presence (
    id TEXT PRIMARY KEY,
    seen_ms BIGINT NOT NULL
);
