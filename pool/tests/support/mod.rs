//! Test support: pools on SQLite or on a private PostgreSQL server.
//!
//! PostgreSQL: when `DEVLEND_TEST_POSTGRES_URL` is set (a superuser URL such as
//! `postgres://postgres@127.0.0.1:5432/postgres`) that server is used. Otherwise one
//! private server is started per test binary from Debian's packages
//! (`/usr/lib/postgresql/*/bin`): initdb and postgres run as the `postgres` system
//! user (postgres refuses root) in a temporary directory, listening on 127.0.0.1 on a
//! free port with `fsync=off`; it is killed and its directory removed when the test
//! binary exits. Each test gets a fresh database. Without PostgreSQL installed the
//! PostgreSQL tests fail and say to run `bash qemu/install-deps.sh`.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use devlend_fabric::lease_token::TokenSigner;
use devlend_pool::api::{DeviceSpec, EnrollRequest, Provider, RegisterProvider, Role};
use devlend_pool::auth::AuthMode;
use devlend_pool::{PoolClient, PoolServer, ServerConfig};
use sqlx::Connection;

/// Runs each named test function on both backends: `NAME::sqlite`, `NAME::postgres`.
/// The test file brings `Backend` into scope and declares `#[macro_use] mod support;`.
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn sqlite() {
                super::$name(super::Backend::Sqlite)
            }
            #[test]
            fn postgres() {
                super::$name(super::Backend::Postgres)
            }
        }
    )*};
}

/// The database a test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// A pool server for one test, with a client and its database.
pub struct TestPool {
    pub server: PoolServer,
    /// A client signing as the pool's admin (unsigned for an open pool).
    pub client: PoolClient,
    /// The database URL, for a second server on the same database.
    pub database: String,
    /// The admin key file.
    pub admin_key: PathBuf,
    /// The SQLite database's directory (kept while the pool lives).
    pub dir: Option<tempfile::TempDir>,
    /// The admin key's directory (kept while the pool lives).
    pub keys: tempfile::TempDir,
}

impl TestPool {
    pub fn url(&self) -> String {
        self.server.url()
    }
}

/// Starts a pool on a fresh database of `backend`; its client signs as the admin.
pub fn start(backend: Backend) -> TestPool {
    start_with(
        backend,
        AuthMode::Signed {
            trust_first_use: false,
        },
    )
}

/// As [`start`], authenticating as `auth` says.
pub fn start_with(backend: Backend, auth: AuthMode) -> TestPool {
    let (database, dir) = fresh_database(backend);
    let keys = tempfile::tempdir().expect("tempdir");
    let admin_key = keys.path().join("admin.key");
    let server = start_on_with(&database, auth, &admin_key);
    let mut client = PoolClient::new(&server.url()).expect("client");
    if auth != AuthMode::Open {
        client = client.with_identity(Arc::new(
            devlend_fabric::identity::load(&admin_key).expect("admin key"),
        ));
    }
    TestPool {
        server,
        client,
        database,
        admin_key,
        dir,
        keys,
    }
}

/// Starts another pool server on `database`, on a free port, with its own admin key,
/// and a client of it that signs with that key.
pub fn start_on(database: &str) -> (PoolServer, PoolClient) {
    let keys = tempfile::tempdir().expect("tempdir");
    let path = keys.path().join("admin.key");
    let server = start_on_with(
        database,
        AuthMode::Signed {
            trust_first_use: false,
        },
        &path,
    );
    let key = devlend_fabric::identity::load(&path).expect("admin key");
    let client = PoolClient::new(&server.url())
        .expect("client")
        .with_identity(Arc::new(key));
    (server, client)
}

/// Starts a pool server on `database` with `auth`, its admin key at `admin_key`.
pub fn start_on_with(database: &str, auth: AuthMode, admin_key: &std::path::Path) -> PoolServer {
    PoolServer::start(ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        database: Some(database.to_string()),
        data_dir: PathBuf::from("/nonexistent"),
        auth,
        admin_key_file: Some(admin_key.to_path_buf()),
        ..Default::default()
    })
    .expect("pool server starts")
}

/// A client of `pool` signing with a new key enrolled as `role` `name`.
pub fn enrolled(pool: &TestPool, role: Role, name: &str) -> PoolClient {
    let key = TokenSigner::generate().expect("key");
    pool.client
        .enroll(&EnrollRequest {
            role,
            name: name.into(),
            public_key: Some(key.public_key().to_text()),
            ttl_ms: None,
        })
        .expect("enroll");
    PoolClient::new(&pool.url())
        .expect("client")
        .with_identity(Arc::new(key))
}

/// A fresh, empty database URL (and the directory holding it, for SQLite).
pub fn fresh_database(backend: Backend) -> (String, Option<tempfile::TempDir>) {
    match backend {
        Backend::Sqlite => {
            let dir = tempfile::tempdir().expect("tempdir");
            let url = format!("sqlite://{}", dir.path().join("pool.db").display());
            (url, Some(dir))
        }
        Backend::Postgres => (postgres_database(), None),
    }
}

/// A device spec.
pub fn device(name: &str, class: &str, capacity: u64, traits: &[&str]) -> DeviceSpec {
    DeviceSpec {
        name: name.into(),
        resource_class: class.into(),
        capacity_bytes: capacity,
        traits: traits.iter().map(|t| t.to_string()).collect(),
    }
}

/// Registers provider `name` with `devices` and a heartbeat TTL.
pub fn register(
    client: &PoolClient,
    name: &str,
    ttl_ms: u64,
    devices: Vec<DeviceSpec>,
) -> Provider {
    client
        .register_provider(
            name,
            &RegisterProvider {
                fabric_address: format!("{name}.example:7700"),
                fabric_paths: vec![],
                transports: vec!["tcp".into()],
                heartbeat_ttl_ms: ttl_ms,
                devices,
            },
        )
        .expect("register provider")
}

pub const GIB: u64 = 1 << 30;

// ---- PostgreSQL ------------------------------------------------------------------

static DB_COUNTER: AtomicU32 = AtomicU32::new(0);

/// Base URL (superuser, no database) of the server the tests use.
fn postgres_base() -> String {
    static SERVER: OnceLock<Result<String, String>> = OnceLock::new();
    SERVER
        .get_or_init(|| match std::env::var("DEVLEND_TEST_POSTGRES_URL") {
            Ok(url) if !url.is_empty() => Ok(url),
            _ => start_private_postgres(),
        })
        .clone()
        .unwrap_or_else(|e| panic!("{e}"))
}

fn with_database(base: &str, db: &str) -> String {
    let mut url = reqwest::Url::parse(base).expect("DEVLEND_TEST_POSTGRES_URL parses");
    url.set_path(&format!("/{db}"));
    url.to_string()
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(f)
}

/// Creates a fresh database on the test server and returns its URL.
fn postgres_database() -> String {
    let base = postgres_base();
    let name = format!(
        "devlend_test_{}_{}",
        std::process::id(),
        DB_COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    let admin = with_database(&base, "postgres");
    block_on(async {
        let mut c = sqlx::PgConnection::connect(&admin)
            .await
            .expect("connect to the test PostgreSQL server");
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut c)
            .await
            .expect("create a test database");
    });
    with_database(&base, &name)
}

struct Private {
    dir: PathBuf,
    child: Child,
}

static PRIVATE: Mutex<Option<Private>> = Mutex::new(None);

extern "C" fn stop_private_postgres() {
    let Ok(mut g) = PRIVATE.lock() else { return };
    let Some(mut p) = g.take() else { return };
    // The postmaster's pid is the first line of postmaster.pid (runuser may sit
    // between us and it). SIGQUIT: immediate shutdown, children included.
    if let Ok(s) = std::fs::read_to_string(p.dir.join("data/postmaster.pid")) {
        if let Some(pid) = s.lines().next().and_then(|l| l.trim().parse::<i32>().ok()) {
            // SAFETY: kill(2) with a pid read from the server's own pid file.
            unsafe { libc::kill(pid, libc::SIGQUIT) };
            let t = Instant::now();
            // SAFETY: kill(2) with signal 0 only probes whether the process exists.
            while unsafe { libc::kill(pid, 0) } == 0 && t.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    let _ = p.child.kill();
    let _ = p.child.wait();
    let _ = std::fs::remove_dir_all(&p.dir);
}

fn postgres_bin_dir() -> Option<PathBuf> {
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            (bin.join("initdb").exists() && bin.join("postgres").exists()).then_some((v, bin))
        })
        .collect();
    dirs.sort();
    dirs.pop().map(|(_, b)| b)
}

fn run(cmd: &mut Command, what: &str) -> Result<(), String> {
    let out = cmd
        .output()
        .map_err(|e| format!("{what}: cannot run: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn start_private_postgres() -> Result<String, String> {
    let bin = postgres_bin_dir().ok_or_else(|| {
        "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/{initdb,postgres}): \
         run `bash qemu/install-deps.sh`, or set DEVLEND_TEST_POSTGRES_URL to a server"
            .to_string()
    })?;
    let dir = tempfile::Builder::new()
        .prefix("devlend-pool-pg-")
        .tempdir()
        .map_err(|e| format!("tempdir: {e}"))?
        .keep();
    let data = dir.join("data");
    let sock = dir.join("sock");
    std::fs::create_dir_all(&sock).map_err(|e| format!("mkdir: {e}"))?;
    run(
        Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(&dir),
        "chown the PostgreSQL test directory to user postgres",
    )?;
    run(
        Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(bin.join("initdb"))
            .args(["-D"])
            .arg(&data)
            .args(["-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync"]),
        "initdb",
    )?;
    let port = free_port();
    let log = std::fs::File::create(dir.join("postgres.log")).map_err(|e| format!("log: {e}"))?;
    let child = Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(bin.join("postgres"))
        .arg("-D")
        .arg(&data)
        .arg("-k")
        .arg(&sock)
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-c", "fsync=off", "-c", "synchronous_commit=off"])
        .args(["-c", "full_page_writes=off", "-c", "max_connections=300"])
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(|e| format!("log: {e}"))?)
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot start postgres: {e}"))?;
    *PRIVATE.lock().unwrap() = Some(Private {
        dir: dir.clone(),
        child,
    });
    // SAFETY: registers a plain extern "C" fn without arguments to run at exit.
    unsafe { libc::atexit(stop_private_postgres) };
    let base = format!("postgres://postgres@127.0.0.1:{port}");
    let admin = with_database(&base, "postgres");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if block_on(async { sqlx::PgConnection::connect(&admin).await.is_ok() }) {
            return Ok(base);
        }
        let exited = PRIVATE
            .lock()
            .unwrap()
            .as_mut()
            .and_then(|p| p.child.try_wait().ok().flatten());
        if exited.is_some() || Instant::now() > deadline {
            let log = std::fs::read_to_string(dir.join("postgres.log")).unwrap_or_default();
            return Err(format!("the test PostgreSQL server did not start:\n{log}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
