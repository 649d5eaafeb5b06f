//! Running the pool: [`serve`] inside a tokio runtime, or [`PoolServer`] on a
//! background thread for programs and tests without one.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;

use devlend_fabric::lease_token::PublicKey;
use tokio::net::TcpListener;

use tokio_rustls::TlsAcceptor;

use crate::auth::AuthMode;
use crate::error::{Error, Result};
use crate::listen::{Limits, TlsFiles};
use crate::service::PoolService;

/// Address the pool listens on by default.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7400";
/// Directory of the SQLite database by default.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/devlend/pool";
/// File name of the SQLite database in the data directory.
pub const DATABASE_FILE: &str = "pool.db";
/// File name of the admin key in the data directory.
pub const ADMIN_KEY_FILE: &str = "admin.key";

/// Where the pool listens and keeps its data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// HTTP listen address (port 0: any free port).
    pub listen: SocketAddr,
    /// HTTPS: serve TLS with this certificate and key; None: plain HTTP.
    pub tls: Option<TlsFiles>,
    /// Connection limits (handshake and header timeout, connections at once).
    pub limits: Limits,
    /// Database URL: `sqlite:///PATH`, `sqlite::memory:`, or
    /// `postgres://USER[:PASSWORD]@HOST[:PORT]/DB`. None: SQLite at
    /// `data_dir/pool.db`.
    pub database: Option<String>,
    /// Directory for the SQLite database when `database` is None, and for the admin
    /// key; created (mode 0700) at first start.
    pub data_dir: PathBuf,
    /// How requests are authenticated.
    pub auth: AuthMode,
    /// The admin key file, made at first start when missing (default:
    /// `data_dir/admin.key`). Unused in [`AuthMode::Open`].
    pub admin_key_file: Option<PathBuf>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: DEFAULT_LISTEN
                .parse()
                .expect("the default listen address parses"),
            tls: None,
            limits: Limits::default(),
            database: None,
            data_dir: PathBuf::from(DEFAULT_DATA_DIR),
            auth: AuthMode::Signed {
                trust_first_use: false,
            },
            admin_key_file: None,
        }
    }
}

impl ServerConfig {
    /// The admin key file: `admin_key_file`, or `data_dir/admin.key`.
    pub fn admin_key_path(&self) -> PathBuf {
        self.admin_key_file
            .clone()
            .unwrap_or_else(|| self.data_dir.join(ADMIN_KEY_FILE))
    }

    /// The database URL to connect to: `database`, with `?mode=rwc` added to a SQLite
    /// file URL without options (so the file is created), or the data directory's
    /// `pool.db`, creating the directory (0700) and the file (0600).
    ///
    /// # Errors
    /// [`Error::Io`] when the data directory cannot be created.
    pub fn database_url(&self) -> Result<String> {
        match &self.database {
            Some(url)
                if url.starts_with("sqlite:")
                    && !url.contains(":memory:")
                    && !url.contains('?') =>
            {
                Ok(format!("{url}?mode=rwc"))
            }
            Some(url) => Ok(url.clone()),
            None => {
                use std::os::unix::fs::DirBuilderExt;
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(&self.data_dir)
                    .map_err(|e| {
                        Error::io(
                            format!(
                                "cannot create the data directory {}",
                                self.data_dir.display()
                            ),
                            e,
                        )
                    })?;
                let path = self.data_dir.join(DATABASE_FILE);
                // Created here, 0600, so that SQLite (which gives its WAL and shared
                // memory files the database file's mode) keeps the signing key private.
                use std::os::unix::fs::OpenOptionsExt;
                match std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&path)
                {
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                    Err(e) => {
                        return Err(Error::io(
                            format!("cannot create the database {}", path.display()),
                            e,
                        ))
                    }
                }
                Ok(format!("sqlite://{}?mode=rwc", path.display()))
            }
        }
    }
}

/// What [`prepare`] makes ready: the service, the bound listener, and the TLS
/// acceptor for HTTPS.
struct Prepared {
    service: PoolService,
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    limits: Limits,
}

impl Prepared {
    fn url(&self) -> Result<String> {
        let addr = self
            .listener
            .local_addr()
            .map_err(|e| Error::io("no local address", e))?;
        Ok(format!(
            "{}://{addr}",
            crate::listen::scheme(self.tls.is_some())
        ))
    }

    async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
        let presence = tokio::spawn(keep_present(self.service.clone()));
        let router = crate::http::router(self.service);
        let served =
            crate::listen::run(router, self.listener, self.tls, self.limits, shutdown).await;
        presence.abort();
        served
    }
}

/// Records this server's presence in the database every
/// [`crate::service::PRESENCE_INTERVAL`], so that the pool's absence is told from a
/// quiet pool. A database that cannot be reached is logged at most every 30 s; its
/// return makes up for the absence ([`PoolService::look`]).
async fn keep_present(service: PoolService) {
    let mut tick = tokio::time::interval(crate::service::PRESENCE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut logged: Option<std::time::Instant> = None;
    loop {
        tick.tick().await;
        if let Err(e) = service.look().await {
            if logged.is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(30)) {
                tracing::warn!(error = %e, "cannot reach the pool's database; leases are judged again only once it is back");
                logged = Some(std::time::Instant::now());
            }
        }
    }
}

/// Loads the TLS files, opens the database and binds the listener; the parts [`serve`]
/// and [`PoolServer::start`] share. The certificate comes first: a bad one fails before
/// the database is touched.
async fn prepare(config: &ServerConfig) -> Result<Prepared> {
    let tls = config
        .tls
        .as_ref()
        .map(crate::listen::acceptor)
        .transpose()?;
    let url = config.database_url()?;
    let service = PoolService::open(&url).await?.with_auth(config.auth);
    match config.auth {
        AuthMode::Open => tracing::warn!(
            "INSECURE: --insecure-open-api: the pool API is open to anyone who reaches {}: \
             anyone can register lenders, redirect borrowers and release leases",
            config.listen
        ),
        AuthMode::Signed { trust_first_use } => {
            let path = config.admin_key_path();
            let key = service.bootstrap_admin(&path).await?;
            tracing::info!(
                admin_key_file = %path.display(),
                admin_key = %key.to_text(),
                trust_first_use,
                "requests must be signed by enrolled keys"
            );
        }
    }
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|e| Error::io(format!("cannot listen on {}", config.listen), e))?;
    Ok(Prepared {
        service,
        listener,
        tls,
        limits: config.limits,
    })
}

/// Resolves at SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let term = async {
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

/// Runs the pool until SIGINT or SIGTERM. Logs the URL and the signing key at start.
///
/// # Errors
/// The database cannot be opened or migrated, the address cannot be bound, or the
/// server fails.
pub async fn serve(config: ServerConfig) -> Result<()> {
    serve_with_shutdown(config, shutdown_signal()).await
}

/// Runs the pool until `shutdown` resolves.
///
/// # Errors
/// As [`serve`].
pub async fn serve_with_shutdown(
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let p = prepare(&config).await?;
    tracing::info!(
        url = %p.url()?,
        public_key = %p.service.public_key().to_text(),
        backend = ?p.service.store().backend(),
        max_connections = p.limits.max_connections,
        header_timeout_s = p.limits.header_timeout.as_secs_f64(),
        "pool serving"
    );
    p.run(shutdown).await
}

/// A pool running on its own tokio runtime on a background thread; stops on drop.
#[derive(Debug)]
pub struct PoolServer {
    addr: SocketAddr,
    url: String,
    public_key: PublicKey,
    handle: tokio::runtime::Handle,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PoolServer {
    /// Opens the database, binds `config.listen` and starts serving; returns once the
    /// pool accepts requests.
    ///
    /// # Errors
    /// As [`serve`]; [`Error::Io`] when the runtime or thread cannot be made.
    pub fn start(config: ServerConfig) -> Result<PoolServer> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("devlend-pool")
            .enable_all()
            .build()
            .map_err(|e| Error::io("cannot start a tokio runtime", e))?;
        let p = rt.block_on(prepare(&config))?;
        let addr = p
            .listener
            .local_addr()
            .map_err(|e| Error::io("no local address", e))?;
        let url = p.url()?;
        let public_key = p.service.public_key();
        tracing::info!(
            url = %url,
            public_key = %public_key.to_text(),
            backend = ?p.service.store().backend(),
            "pool serving"
        );
        let handle = rt.handle().clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("devlend-pool".into())
            .spawn(move || {
                let shutdown = async {
                    let _ = rx.await;
                };
                if let Err(e) = rt.block_on(p.run(shutdown)) {
                    tracing::error!(error = %e, "pool server stopped");
                }
            })
            .map_err(|e| Error::io("cannot start the pool thread", e))?;
        Ok(PoolServer {
            addr,
            url,
            public_key,
            handle,
            shutdown: Some(tx),
            thread: Some(thread),
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its base URL, `http://ADDR`, or `https://ADDR` when serving TLS.
    pub fn url(&self) -> String {
        self.url.clone()
    }

    /// The key its lease tokens are signed with.
    pub fn public_key(&self) -> PublicKey {
        self.public_key
    }

    /// Blocks the calling thread until SIGINT or SIGTERM.
    pub fn wait_for_signal(&self) {
        self.handle.block_on(shutdown_signal());
    }

    /// Stops serving (requests in flight complete) and joins the thread.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
            tracing::info!(addr = %self.addr, "pool stopped");
        }
    }
}

impl Drop for PoolServer {
    fn drop(&mut self) {
        self.stop_inner();
    }
}
