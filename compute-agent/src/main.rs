//! `devlend-compute-agent`: the borrower daemon.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use devlend_compute_agent::config::{Cli, Config};
use devlend_compute_agent::metrics::AttachmentMetrics;
use devlend_compute_agent::registry::Registry;
use devlend_compute_agent::server::{self, Reload};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (config, log) = match devlend_daemon::startup(
        "devlend-compute-agent",
        Config::load(&cli),
        cli.common.print_config,
    ) {
        Ok(x) => x,
        Err(code) => return code,
    };
    match run(cli, config, log) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("devlend-compute-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli, config: Config, log: devlend_daemon::logging::LogHandle) -> anyhow::Result<()> {
    let mut registry = Registry::default();
    if let Some(path) = &config.auth_key_file {
        let text = std::fs::read_to_string(path).map_err(|e| {
            anyhow::anyhow!("cannot read the auth key file {}: {e}", path.display())
        })?;
        let signer = devlend_fabric::lease_token::TokenSigner::from_seed_text(&text)
            .map_err(|e| anyhow::anyhow!("auth key file {}: {e}", path.display()))?;
        tracing::info!(public_key = %signer.public_key().to_text(), "direct attachments authenticate with this key");
        registry.set_signer(signer);
    }
    // The pool key: a configured file must be usable; the default one is made when the
    // agent may write its state directory (an agent run without root for direct mode
    // only goes on without one, and says so).
    let key_path = config.pool_key_file.clone().unwrap_or_else(|| {
        std::path::PathBuf::from(devlend_compute_agent::config::DEFAULT_POOL_KEY_FILE)
    });
    match devlend_fabric::identity::load_or_create(&key_path) {
        Ok((key, made)) => {
            if made {
                tracing::info!(path = %key_path.display(), key = %key.public_key().to_text(), "made this compute host's pool key: enroll it with `devlend pool join`");
            }
            registry.set_pool_identity(std::sync::Arc::new(key));
        }
        Err(e) if config.pool_key_file.is_none() => {
            tracing::warn!(error = %devlend_fabric::error::chain(&e), "no pool key: leases from a pool that requires signed requests will be refused");
        }
        Err(e) => return Err(anyhow::anyhow!("{}", devlend_fabric::error::chain(&e))),
    }
    if let Some(key) = &config.pool_public_key {
        let key = devlend_fabric::lease_token::PublicKey::from_text(key)
            .map_err(|e| anyhow::anyhow!("pool_public_key: {e}"))?;
        registry.set_pool_key(key);
    }
    if let Some(ca) = &config.pool_ca_file {
        // Read now, so that a bad file stops the agent at start, not at the first lease.
        devlend_pool::https::client_config(Some(ca))
            .map_err(|e| anyhow::anyhow!("{}", devlend_fabric::error::chain(&e)))?;
        registry.set_pool_ca(ca.clone());
    }
    let state_err = |e: devlend_compute_agent::state::StateError| {
        anyhow::anyhow!("{}", devlend_fabric::error::chain(&e))
    };
    // Held until exit: one agent per state file.
    let mut _state_lock = None;
    let saved = match &config.state_file {
        Some(path) => {
            _state_lock =
                Some(devlend_compute_agent::state::lock(path, &config.api).map_err(state_err)?);
            let saved = devlend_compute_agent::state::StateFile::load(path).map_err(state_err)?;
            registry.set_state_file(path.clone());
            saved.attachments
        }
        None => Vec::new(),
    };
    if let Some(tls) = config.client_tls()? {
        tracing::info!("attachments made with tls: true verify their lender's certificate");
        registry.set_tls(tls);
    }
    if let Some((cluster, gateway)) = config.gateway()? {
        tracing::info!(%cluster, %gateway, "lenders addressed CLUSTER/LENDER are reached through this gateway");
        registry.set_gateway(cluster, gateway);
    }
    registry.set_restoring(saved.clone());
    // An unwritable state file is found now, not at the first attach.
    registry.check_state_file().map_err(state_err)?;
    let registry = Arc::new(registry);
    if let Some(addr) = config.metrics_listen {
        devlend_daemon::metrics::serve(addr, AttachmentMetrics(registry.clone()))?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // The saved attachments are served again once the API socket is this process's
    // (a second agent started by mistake stops before it touches them).
    let restore = {
        let registry = registry.clone();
        move || {
            if !saved.is_empty() {
                if let Err(e) = devlend_compute_agent::restore::spawn(registry, saved) {
                    tracing::error!(error = %e, "cannot start restoring the saved attachments");
                }
            }
        }
    };
    rt.block_on(server::serve(
        &config.api,
        registry,
        Some(Reload { cli, log }),
        Some(Box::new(restore)),
    ))
}
