//! The signer of a request, as the gate established it, and the checks routes make.

use crate::api::{codes, Principal, Role};
use crate::error::Error;

/// Who sent a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// The pool runs with `--insecure-open-api`: everyone may do everything.
    Open,
    /// The request carried no signature.
    Anonymous,
    /// A valid signature by a key that is not enrolled.
    Unenrolled {
        /// The key, unpadded base64url.
        key: String,
    },
    /// An enrolled key.
    Principal(Principal),
}

fn forbidden(p: &Principal, what: &str) -> Error {
    Error::Rejected {
        status: 403,
        code: codes::FORBIDDEN,
        message: format!("{} {:?} may not {what}", p.role, p.name),
    }
}

impl Caller {
    /// The refusal for a caller that is not an enrolled principal; `None` for one that is
    /// (or in open mode).
    fn unenrolled(&self) -> Option<Error> {
        match self {
            Caller::Open | Caller::Principal(_) => None,
            Caller::Anonymous => Some(Error::Rejected {
                status: 401,
                code: codes::UNAUTHENTICATED,
                message: "this request must be signed with an enrolled key \
                          (Authorization: Devlend-Ed25519; see docs/security.md)"
                    .into(),
            }),
            Caller::Unenrolled { key } => Some(Error::Rejected {
                status: 403,
                code: codes::UNKNOWN_KEY,
                message: format!(
                    "key {key} is not enrolled (or was revoked): redeem a join token \
                     from `devlend pool enroll` (a compute host with `devlend pool join`, \
                     a lender with `--pool-join-token`)"
                ),
            }),
        }
    }

    fn principal(&self) -> Result<Option<&Principal>, Error> {
        if let Some(e) = self.unenrolled() {
            return Err(e);
        }
        Ok(match self {
            Caller::Principal(p) => Some(p),
            _ => None,
        })
    }

    /// Any enrolled key (reading the inventory).
    ///
    /// # Errors
    /// 401 `unauthenticated`, 403 `unknown_key`.
    pub fn require_enrolled(&self) -> Result<(), Error> {
        self.principal().map(|_| ())
    }

    /// An admin.
    ///
    /// # Errors
    /// 401, 403 `unknown_key`, 403 `forbidden`.
    pub fn require_admin(&self, what: &str) -> Result<(), Error> {
        match self.principal()? {
            Some(p) if p.role != Role::Admin => Err(forbidden(p, what)),
            _ => Ok(()),
        }
    }

    /// An admin, or the lender pinned to provider `name`.
    ///
    /// # Errors
    /// 401, 403 `unknown_key`, 403 `forbidden`.
    pub fn require_provider(&self, name: &str) -> Result<(), Error> {
        match self.principal()? {
            Some(p) if p.role == Role::Admin => Ok(()),
            Some(p) if p.role == Role::Lender && p.name == name => Ok(()),
            Some(p) => Err(forbidden(p, &format!("act for provider {name:?}"))),
            None => Ok(()),
        }
    }

    /// An admin, or the compute host `host`.
    ///
    /// # Errors
    /// 401, 403 `unknown_key`, 403 `forbidden`.
    pub fn require_compute_host(&self, host: &str) -> Result<(), Error> {
        match self.principal()? {
            Some(p) if p.role == Role::Admin => Ok(()),
            Some(p) if p.role == Role::Compute && p.name == host => Ok(()),
            Some(p) => Err(forbidden(
                p,
                &format!("act on leases of compute host {host:?}"),
            )),
            None => Ok(()),
        }
    }

    /// Whether this caller may see a lease of `compute_host` served by `provider`: an
    /// admin (or open mode) sees every lease, a compute host its own, a lender those of
    /// its provider.
    pub fn sees_lease(&self, compute_host: &str, provider: &str) -> bool {
        match self {
            Caller::Open => true,
            Caller::Principal(p) => match p.role {
                Role::Admin => true,
                Role::Compute => p.name == compute_host,
                Role::Lender => p.name == provider,
            },
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(role: Role, name: &str) -> Caller {
        Caller::Principal(Principal {
            public_key: "k".into(),
            role,
            name: name.into(),
            created_ms: 0,
        })
    }

    fn status(r: Result<(), Error>) -> u16 {
        match r {
            Ok(()) => 200,
            Err(Error::Rejected { status, .. }) => status,
            Err(_) => 500,
        }
    }

    #[test]
    fn each_role_may_do_its_own_part_only() {
        let admin = p(Role::Admin, "ops");
        let lender = p(Role::Lender, "store1");
        let compute = p(Role::Compute, "host1");
        let anon = Caller::Anonymous;
        let stranger = Caller::Unenrolled { key: "x".into() };
        assert_eq!(status(admin.require_provider("store1")), 200);
        assert_eq!(status(lender.require_provider("store1")), 200);
        assert_eq!(status(lender.require_provider("store2")), 403);
        assert_eq!(status(compute.require_provider("store1")), 403);
        assert_eq!(status(compute.require_compute_host("host1")), 200);
        assert_eq!(status(compute.require_compute_host("host2")), 403);
        assert_eq!(status(lender.require_compute_host("host1")), 403);
        assert_eq!(status(lender.require_admin("enroll")), 403);
        assert_eq!(status(admin.require_admin("enroll")), 200);
        assert_eq!(status(anon.require_enrolled()), 401);
        assert_eq!(status(stranger.require_enrolled()), 403);
        assert_eq!(status(Caller::Open.require_admin("x")), 200);
        assert!(compute.sees_lease("host1", "store9"));
        assert!(!compute.sees_lease("host2", "store9"));
        assert!(lender.sees_lease("host2", "store1"));
        assert!(!anon.sees_lease("host1", "store1"));
    }
}
