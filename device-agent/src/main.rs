//! `devlend-device-agent`: lends block devices and regular files to devlend borrowers.
//! See the crate's README for options and the config file.

use std::process::ExitCode;

use clap::Parser;
use devlend_device_agent::exposure::{allow_unauthenticated, Unauthenticated};
use devlend_device_agent::metrics::DeviceMetrics;
use devlend_device_agent::pool_link::{PoolLink, PoolSession, STARTUP_WAIT};
use devlend_device_agent::{Cli, Config, Lender};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (config, log) = match devlend_daemon::startup(
        "devlend-device-agent",
        Config::from_cli(&cli),
        cli.common.print_config,
    ) {
        Ok(x) => x,
        Err(code) => return code,
    };
    match run(&cli, config, &log) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("devlend-device-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Serves until SIGTERM or SIGINT, then drains: sessions answer what they have in
/// flight, then close. SIGHUP re-reads the configuration: the log level and the device
/// list (added devices are lent, removed ones are refused unless a borrower holds them).
fn run(cli: &Cli, config: Config, log: &devlend_daemon::logging::LogHandle) -> anyhow::Result<()> {
    // Signals first, so that none arrives unhandled once sessions run.
    let mut signals = Signals::new([SIGTERM, SIGINT, SIGHUP])?;
    // TLS files are read before the port is bound: a bad one stops the agent before it
    // says it listens.
    let tls = match (&config.tls_cert, &config.tls_key) {
        (Some(cert), Some(key)) => Some((
            cert.clone(),
            devlend_fabric::tls::ServerTls::load(cert, key, config.tls_client_ca.as_deref())
                .map_err(devlend_device_agent::Error::Tls)?,
        )),
        _ => None,
    };
    let client_certs = tls.as_ref().is_some_and(|(_, t)| t.requires_client_cert());
    // Before binding (TCP, and RDMA on the same address): a lender that authenticates
    // no borrower serves beyond loopback only with --insecure.
    let unauthenticated = if config.pool.is_none() && config.auth_keys.is_empty() && !client_certs {
        Some(allow_unauthenticated(&config.listen, config.insecure)?)
    } else {
        None
    };
    let mut options = devlend_device_agent::Options {
        io: config.io_mode,
        stores: config.stores.clone(),
        ..Default::default()
    };
    if let Some(n) = config.max_sessions {
        options.max_sessions = n as usize;
    }
    if let Some(us) = config.poll_us {
        options.poll = std::time::Duration::from_micros(u64::from(us));
    }
    // The lender's own key: it proves who the lender is to borrowers that ask, and signs
    // its pool requests.
    let key = config.load_key()?;
    let previous_key = config.load_previous_key()?;
    let pool_health = devlend_daemon::pool_health::PoolHealth::default();
    // Beside the key: the pool key pinned at first contact and the lease fences.
    let state_file = config
        .key_path()
        .parent()
        .map(|d| d.join(devlend_device_agent::pool_link::STATE_FILE));
    let lender = Lender::bind_with(&config.listen, config.devices, options)?;
    if let Some(k) = &key {
        tracing::info!(key = %k.public_key().to_text(), "this lender's key: borrowers verify it with --lender-key or through the pool's lease");
        lender.prove_with(std::sync::Arc::clone(k));
    }
    if let Some(old) = previous_key.filter(|old| {
        let same = key
            .as_ref()
            .is_some_and(|k| k.public_key() == old.public_key());
        if same {
            tracing::warn!("--previous-key-file holds this lender's current key: nothing to rotate from; ignored");
        }
        !same
    }) {
        tracing::info!(key = %old.public_key().to_text(), "key rotation: this lender also proves its previous key to the borrowers that ask for it");
        lender.also_prove_with(old);
    }
    if let Some((cert, tls)) = tls {
        tracing::info!(
            cert = %cert.display(),
            client_certificates = if client_certs { "required" } else { "not asked for" },
            "TLS 1.3 only: plaintext connections are refused"
        );
        lender.require_tls(tls);
    }
    if config.transport == devlend_device_agent::config::Transport::Rdma {
        lender.serve_rdma(&config.listen)?;
    }
    if let Some(addr) = config.metrics_listen {
        devlend_daemon::metrics::serve(
            addr,
            DeviceMetrics::new(lender.stats_view(), pool_health.clone()),
        )?;
    }
    let pool = match &config.pool {
        Some(p) => {
            let key = key.clone().ok_or_else(|| {
                devlend_device_agent::Error::BadPool(format!(
                    "no key to sign pool requests with: give key_file (--key-file), or let the \
                     agent write {}",
                    devlend_device_agent::config::DEFAULT_KEY_FILE
                ))
            })?;
            let session =
                PoolSession::connect(p, STARTUP_WAIT, key, state_file, pool_health.clone())?;
            session
                .guard()
                .allow_bearer_tokens(config.allow_bearer_tokens);
            lender.require_leases(session.guard());
            Some(session)
        }
        None if !config.auth_keys.is_empty() => {
            let keys = config
                .auth_keys
                .iter()
                .map(|k| devlend_fabric::lease_token::PublicKey::from_text(k))
                .collect::<Result<Vec<_>, _>>()?;
            tracing::info!(
                keys = keys.len(),
                "direct mode: serving borrowers whose tokens verify with a configured key"
            );
            let guard = devlend_device_agent::LeaseGuard::direct(keys);
            guard.allow_bearer_tokens(config.allow_bearer_tokens);
            lender.require_leases(std::sync::Arc::new(guard));
            None
        }
        None if client_certs => {
            tracing::info!("direct mode: serving borrowers whose TLS client certificate verifies with the configured CA");
            None
        }
        None => {
            match unauthenticated {
                Some(Unauthenticated::Insecure) => tracing::warn!(
                    listen = %config.listen,
                    "--insecure: no device pool and no auth key on an address beyond loopback: direct mode, any host that reaches the port can attach an idle device (unauthenticated)"
                ),
                _ => tracing::warn!("no device pool and no auth key: direct mode, any borrower that reaches the port can attach an idle device (unauthenticated)"),
            }
            None
        }
    };
    if config.allow_bearer_tokens {
        tracing::warn!("--allow-bearer-tokens: lease tokens that name no holder key are taken; anyone who saw one on the wire can open its device");
    }
    // Registered, and the live leases known, before the first session is served.
    let link = pool
        .map(|session| PoolLink::start(session, lender.inventory_view()))
        .transpose()?;
    let addr = lender.local_addr();
    let handle = lender.spawn();
    devlend_daemon::notify::ready(&format!("lending on {addr}"));
    for sig in signals.forever() {
        if sig != SIGHUP {
            tracing::info!(
                signal = sig,
                "draining: sessions finish their requests in flight"
            );
            devlend_daemon::notify::stopping();
            break;
        }
        devlend_daemon::notify::reloading();
        match Config::from_cli(cli) {
            Ok(new) => {
                // Apply nothing unless everything is valid.
                if let Err(e) = devlend_daemon::logging::check_level(&new.log_level) {
                    tracing::warn!(error = %e, "reload failed; configuration unchanged");
                } else {
                    match handle.reload(&new.devices) {
                        Ok(r) => {
                            let _ = log.set_level(&new.log_level);
                            if let Some(link) = &link {
                                link.reregister();
                            }
                            tracing::info!(level = %new.log_level, added = ?r.added, removed = ?r.removed, kept_while_attached = ?r.kept_held, "configuration reloaded");
                        }
                        Err(e) => {
                            tracing::warn!(error = %format!("{:#}", anyhow::Error::from(e)), "reload failed; configuration unchanged")
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %format!("{:#}", anyhow::Error::from(e)), "reload failed; configuration unchanged")
            }
        }
        devlend_daemon::notify::ready(&format!("lending on {addr}"));
    }
    drop(link);
    handle.shutdown();
    Ok(())
}
