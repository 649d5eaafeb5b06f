//! devlend's device pool: the inventory of lendable devices across device servers, the
//! leases that bind one device to one borrower for a time, and placement.
//!
//! Features:
//! - `client`: [`api`] (the request and answer types), [`rules`] (the name and address
//!   rules the pool applies, for lenders to check first) and [`client`] (a blocking HTTP
//!   client, plain HTTP or HTTPS: [`https`]). Light: serde, reqwest and rustls. Lenders, borrowers and the CLI use this.
//! - `server` (default, implies `client`): the service itself: [`store`] (sqlx over
//!   SQLite or PostgreSQL, with migrations), [`placement`], [`tokens`] (the signing
//!   key kept in the database), [`http`] (axum routes, JSON errors, OpenAPI),
//!   [`server`] ([`serve`] and the embeddable [`PoolServer`]), [`listen`] (the accept
//!   loop: plain HTTP or HTTPS with rustls, connection limits).
//!
//! The model, every endpoint and the placement rule are in `docs/pool.md`.

pub mod api;
#[cfg(feature = "client")]
pub mod auth;
#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "client")]
pub mod https;
pub mod rules;

#[cfg(feature = "server")]
pub mod enroll;
#[cfg(feature = "server")]
pub mod error;
#[cfg(feature = "server")]
pub mod http;
#[cfg(feature = "server")]
pub mod listen;
#[cfg(feature = "server")]
pub mod placement;
#[cfg(feature = "server")]
pub mod server;
#[cfg(feature = "server")]
pub mod service;
#[cfg(feature = "server")]
pub mod store;
#[cfg(feature = "server")]
pub mod tokens;
#[cfg(feature = "server")]
pub mod validate;

#[cfg(feature = "client")]
pub use client::{ClientError, PoolClient};
#[cfg(feature = "server")]
pub use server::{serve, serve_with_shutdown, PoolServer, ServerConfig};
