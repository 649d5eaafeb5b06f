//! The pool service's error: a refusal with an HTTP status and a code, or a failure of
//! the storage.

use crate::api::codes;

/// Why a pool operation did not happen.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request is refused: `status` is a 4xx, `code` one of [`crate::api::codes`].
    #[error("{message}")]
    Rejected {
        /// HTTP status (400, 404, 409, 413, 422, ...).
        status: u16,
        /// Stable snake_case code.
        code: &'static str,
        /// A sentence for people.
        message: String,
    },
    /// The database failed.
    #[error("database error")]
    Database(#[from] sqlx::Error),
    /// The schema migrations failed.
    #[error("database migration failed")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The signing key is unusable, or a token could not be signed.
    #[error("lease token")]
    Token(#[from] devlend_fabric::lease_token::TokenError),
    /// A file-system or socket operation failed.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The configuration is unusable (database URL, ...).
    #[error("{0}")]
    Config(String),
    /// The pool's admin key file is unusable.
    #[error("admin key")]
    Identity(#[from] devlend_fabric::identity::IdentityError),
    /// The HTTPS certificate or key (`--tls-cert`, `--tls-key`) is unusable.
    #[error("HTTPS certificate")]
    Tls(#[from] devlend_fabric::tls::TlsConfigError),
    /// The metrics text could not be encoded.
    #[error("cannot encode the metrics")]
    Metrics(#[source] std::fmt::Error),
}

/// Shorthand for results of this crate's server side.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// 422 `invalid_value`: a field is out of bounds or of the wrong syntax.
    pub fn invalid(message: impl Into<String>) -> Self {
        Error::Rejected {
            status: 422,
            code: codes::INVALID_VALUE,
            message: message.into(),
        }
    }

    /// 409 with `code`.
    pub fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        Error::Rejected {
            status: 409,
            code,
            message: message.into(),
        }
    }

    /// 404 with `code`.
    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Error::Rejected {
            status: 404,
            code,
            message: message.into(),
        }
    }

    /// 400 with `code`.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Error::Rejected {
            status: 400,
            code,
            message: message.into(),
        }
    }

    /// The `code` of a refusal.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Rejected { code, .. } => code,
            _ => codes::INTERNAL,
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}
