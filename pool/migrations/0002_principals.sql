-- Who may call the pool: enrolled Ed25519 keys with a role and a name, and one-time
-- join tokens (kept as their SHA-256) that pin the key which redeems them.

CREATE TABLE principals (
    public_key TEXT PRIMARY KEY,
    role TEXT NOT NULL,
    name TEXT NOT NULL,
    created_ms BIGINT NOT NULL
);

-- One key per lender name and per compute host: the pinning.
CREATE UNIQUE INDEX principals_role_name ON principals (role, name);

CREATE TABLE join_tokens (
    token_hash TEXT PRIMARY KEY,
    role TEXT NOT NULL,
    name TEXT NOT NULL,
    expires_ms BIGINT NOT NULL
);

-- Nonces of the signed requests that change something (not GET), until their
-- signatures expire: a captured request cannot be replayed after a restart of the pool
-- or to another pool instance on the same database.
CREATE TABLE request_nonces (
    public_key TEXT NOT NULL,
    nonce TEXT NOT NULL,
    expires_ms BIGINT NOT NULL,
    PRIMARY KEY (public_key, nonce)
);

CREATE INDEX request_nonces_expiry ON request_nonces (expires_ms);
