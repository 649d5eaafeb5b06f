//! `devlend-gateway`: the cluster gateway daemon.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use devlend_gateway::config::{Cli, Config};
use devlend_gateway::Gateway;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match Config::load(&cli.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("devlend-gateway: {}", devlend_fabric::error::chain(&e));
            return ExitCode::from(2);
        }
    };
    if cli.print_config {
        match toml::to_string(&config) {
            Ok(t) => print!("{t}"),
            Err(e) => eprintln!("devlend-gateway: cannot print the configuration: {e}"),
        }
        return ExitCode::SUCCESS;
    }
    let level = cli
        .log_level
        .clone()
        .unwrap_or_else(|| config.log_level.clone());
    if let Err(e) = devlend_daemon::logging::init(&level, devlend_daemon::logging::LogFormat::Human)
    {
        eprintln!("devlend-gateway: {e}");
        return ExitCode::from(2);
    }
    match run(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("devlend-gateway: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(config: Config) -> anyhow::Result<()> {
    let gw = Gateway::new(config)
        .map_err(|e| anyhow::anyhow!("TLS: {}", devlend_fabric::error::chain(&e)))?;
    let gw = Arc::new(gw);
    // Kept for the process's lifetime: the endpoint runs on its own thread.
    let _metrics = match gw.config.metrics_listen {
        Some(addr) => Some(devlend_daemon::metrics::serve(
            addr,
            devlend_gateway::metrics::GatewayMetrics(gw.clone()),
        )?),
        None => None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let c = &gw.config;
        let bind = |a| async move {
            tokio::net::TcpListener::bind(a)
                .await
                .map_err(|e| anyhow::anyhow!("cannot listen on {a}: {e}"))
        };
        let local = bind(c.listen).await?;
        let peer = bind(c.peer_listen).await?;
        let control = match c.control {
            Some(a) => Some(bind(a).await?),
            None => None,
        };
        tracing::info!(
            cluster = %c.cluster,
            listen = %c.listen,
            peer_listen = %c.peer_listen,
            control = ?c.control,
            routes = ?c.routes.keys().collect::<Vec<_>>(),
            lenders = ?c.lenders.keys().collect::<Vec<_>>(),
            window = c.window,
            "gateway listening",
        );
        for slot in &gw.peers.slots {
            tokio::spawn(devlend_gateway::peers::keep_peer(gw.clone(), slot.clone()));
        }
        tokio::spawn(devlend_gateway::peers::accept_peers(gw.clone(), peer));
        tokio::spawn(devlend_gateway::relay::serve_local(gw.clone(), local));
        if let Some(l) = control {
            let gw = gw.clone();
            tokio::spawn(async move {
                if let Err(e) = devlend_gateway::status::serve(gw, l).await {
                    tracing::error!(error = %e, "the status endpoint failed");
                }
            });
        }
        devlend_daemon::notify::ready("relaying");
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        devlend_daemon::notify::stopping();
        tracing::info!("gateway stopping");
        anyhow::Ok(())
    })
}
