//! The block engine of a TCP (or TLS) session: the engine's loop ([`engine`]), the
//! request frames it reads ([`rx`]), the responses it writes ([`tx`]) and its budget of
//! requests in flight ([`budget`]). The session layer (`session/tcp/`) reads the
//! hello, admits it and answers it; then the block kind's session runs [`engine::run`].

mod budget;
pub(super) mod engine;
mod rx;
mod tx;

#[cfg(test)]
mod tests;
