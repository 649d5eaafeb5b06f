//! Credentials for the pool: which key file a `devlend` command signs its pool requests
//! with, and the enrollment subcommands (`devlend pool enroll | join | principals |
//! revoke`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use devlend_pool::api::{EnrollRequest, Principal, Role};
use devlend_pool::server::{ADMIN_KEY_FILE, DEFAULT_DATA_DIR};
use devlend_pool::PoolClient;

/// Default pool URL when neither `--pool` nor `DEVLEND_POOL` is given.
pub const DEFAULT_POOL_URL: &str = "http://127.0.0.1:7400";

/// The compute agent's key, which `devlend attach --class` signs its leases with.
pub const COMPUTE_KEY_FILE: &str = "/var/lib/devlend/compute-agent/identity.key";

/// The pool's own admin key file, made by `devlend pool serve` at first start.
pub fn default_admin_key() -> PathBuf {
    Path::new(DEFAULT_DATA_DIR).join(ADMIN_KEY_FILE)
}

/// `--pool-key`: the key file pool requests are signed with; `--pool-ca`: the CA an
/// `https://` pool's certificate is verified against.
#[derive(Debug, Clone, Args)]
pub struct PoolKey {
    /// Key file that signs pool requests (from `devlend keygen`, or made by the agent or
    /// the pool). Default: the pool's admin key on the pool host, unsigned if it is
    /// absent (a pool run with --insecure-open-api).
    #[arg(long = "pool-key", env = "DEVLEND_POOL_KEY", value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// CA certificates (PEM) the certificate of an https:// pool must chain to.
    /// Default: the system's trust store.
    #[arg(long = "pool-ca", env = "DEVLEND_POOL_CA", value_name = "FILE")]
    pub ca: Option<PathBuf>,
}

impl PoolKey {
    /// A client of `url` that signs with the key: the given file (which must exist), or
    /// `default` when it exists; trusting `--pool-ca` for HTTPS.
    ///
    /// # Errors
    /// A bad URL, a CA file or key file that cannot be read.
    pub fn client(&self, url: &str, default: &Path) -> Result<PoolClient> {
        let client = PoolClient::with_ca(url, self.ca.as_deref())
            .with_context(|| format!("pool URL {url:?}"))?;
        let path = match &self.file {
            Some(p) => p.clone(),
            None if default.exists() => default.to_path_buf(),
            None => return Ok(client),
        };
        let key = devlend_fabric::identity::load(&path)?;
        Ok(client.with_identity(Arc::new(key)))
    }
}

/// `devlend pool enroll`.
#[derive(Debug, Clone, Args)]
pub struct Enroll {
    /// Pool URL.
    #[arg(long, env = "DEVLEND_POOL", default_value = DEFAULT_POOL_URL)]
    pub pool: String,
    /// The role: lender (a provider name) or compute (a compute host name); admin too.
    #[arg(long, value_parser = parse_role)]
    pub role: Role,
    /// The provider name (lender) or the compute host name (compute).
    #[arg(long)]
    pub name: String,
    /// Pin this public key now (from `devlend keygen`) instead of printing a join token.
    #[arg(long, allow_hyphen_values = true)]
    pub public_key: Option<String>,
    /// How long the join token stays valid, in seconds.
    #[arg(long, default_value_t = 3600)]
    pub ttl_secs: u64,
    /// The admin key.
    #[command(flatten)]
    pub key: PoolKey,
}

/// `devlend pool join`.
#[derive(Debug, Clone, Args)]
pub struct Join {
    /// Pool URL.
    #[arg(long, env = "DEVLEND_POOL", default_value = DEFAULT_POOL_URL)]
    pub pool: String,
    /// The join token `devlend pool enroll` printed.
    #[arg(long)]
    pub token: String,
    /// The key file to enroll; made (0600) when it does not exist yet. Default: the
    /// compute agent's key.
    #[arg(long, default_value = COMPUTE_KEY_FILE)]
    pub key: PathBuf,
    /// CA certificates (PEM) the certificate of an https:// pool must chain to.
    /// Default: the system's trust store.
    #[arg(long = "pool-ca", env = "DEVLEND_POOL_CA", value_name = "FILE")]
    pub pool_ca: Option<PathBuf>,
}

fn parse_role(s: &str) -> Result<Role, String> {
    Role::parse(s).ok_or_else(|| format!("{s:?} is not admin, lender or compute"))
}

/// Runs `devlend pool enroll`: prints the join token, or the pinned principal.
///
/// # Errors
/// The pool refuses (not an admin) or cannot be reached.
pub fn enroll(e: &Enroll) -> Result<()> {
    let client = e.key.client(&e.pool, &default_admin_key())?;
    if client.identity().is_none() {
        bail!(
            "no admin key: give --pool-key (the pool's admin key is {} on its host)",
            default_admin_key().display()
        );
    }
    let answer = client.enroll(&EnrollRequest {
        role: e.role,
        name: e.name.clone(),
        ttl_ms: e
            .public_key
            .is_none()
            .then(|| e.ttl_secs.saturating_mul(1000)),
        public_key: e.public_key.clone(),
    })?;
    match (answer.principal, answer.join_token) {
        (Some(p), _) => println!("{}", principal_line(&p)),
        (None, Some(token)) => println!("{token}"),
        (None, None) => bail!("the pool answered neither a principal nor a token"),
    }
    Ok(())
}

/// Runs `devlend pool join`: makes the key if needed and redeems the token with it.
///
/// # Errors
/// The key file cannot be made, or the pool refuses the token.
pub fn join(j: &Join) -> Result<()> {
    let (key, made) = devlend_fabric::identity::load_or_create(&j.key)?;
    if made {
        eprintln!("made key {}", j.key.display());
    }
    let client = PoolClient::with_ca(&j.pool, j.pool_ca.as_deref())
        .with_context(|| format!("pool URL {:?}", j.pool))?
        .with_identity(Arc::new(key));
    let p = client.join(&j.token)?;
    println!("{}", principal_line(&p));
    Ok(())
}

/// One line per principal: role, name, key.
pub fn principal_line(p: &Principal) -> String {
    format!("{:<8} {:<24} {}", p.role, p.name, p.public_key)
}
