//! Certificates for TLS tests, made fresh in a directory (rcgen, ECDSA P-256).
//!
//! | file | what |
//! | --- | --- |
//! | `ca.crt` | the test CA |
//! | `lender.crt`, `lender.key` | a server certificate for `localhost` and `127.0.0.1`, signed by the CA |
//! | `borrower.crt`, `borrower.key` | a client certificate, signed by the CA |
//! | `other-ca.crt` | an unrelated CA |
//! | `stranger.crt`, `stranger.key` | a client certificate signed by the unrelated CA |
//! | `gw-a.crt`, `gw-a.key`, `gw-b.crt`, `gw-b.key` | gateway certificates (server and client) for the names `gw-a`, `gw-b` |

use std::path::{Path, PathBuf};

use anyhow::Result;

/// The directory holding the files above.
pub struct Certs {
    dir: PathBuf,
}

struct Ca {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

fn ca(name: &str) -> Result<Ca> {
    let key = rcgen::KeyPair::generate()?;
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new())?;
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    p.distinguished_name.push(rcgen::DnType::CommonName, name);
    p.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let cert = p.self_signed(&key)?;
    Ok(Ca { cert, key })
}

fn leaf(dir: &Path, name: &str, ca: &Ca, names: &[&str], server: bool) -> Result<()> {
    let eku = if server {
        rcgen::ExtendedKeyUsagePurpose::ServerAuth
    } else {
        rcgen::ExtendedKeyUsagePurpose::ClientAuth
    };
    leaf_with(dir, name, ca, names, vec![eku])
}

fn leaf_with(
    dir: &Path,
    name: &str,
    ca: &Ca,
    names: &[&str],
    eku: Vec<rcgen::ExtendedKeyUsagePurpose>,
) -> Result<()> {
    let key = rcgen::KeyPair::generate()?;
    let mut p =
        rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())?;
    p.distinguished_name.push(rcgen::DnType::CommonName, name);
    p.extended_key_usages = eku;
    let cert = p.signed_by(&key, &ca.cert, &ca.key)?;
    std::fs::write(dir.join(format!("{name}.crt")), cert.pem())?;
    std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem())?;
    Ok(())
}

impl Certs {
    /// Makes every file of the table in `dir` (created if needed).
    ///
    /// # Errors
    /// A key cannot be generated or a file cannot be written.
    pub fn make(dir: &Path) -> Result<Certs> {
        std::fs::create_dir_all(dir)?;
        let good = ca("devlend test CA")?;
        let other = ca("unrelated CA")?;
        std::fs::write(dir.join("ca.crt"), good.cert.pem())?;
        std::fs::write(dir.join("other-ca.crt"), other.cert.pem())?;
        leaf(dir, "lender", &good, &["localhost", "127.0.0.1"], true)?;
        leaf(dir, "borrower", &good, &["borrower"], false)?;
        leaf(dir, "stranger", &other, &["stranger"], false)?;
        // Gateways are TLS servers and clients of each other: both usages.
        for gw in ["gw-a", "gw-b"] {
            leaf_with(
                dir,
                gw,
                &good,
                &[gw],
                vec![
                    rcgen::ExtendedKeyUsagePurpose::ServerAuth,
                    rcgen::ExtendedKeyUsagePurpose::ClientAuth,
                ],
            )?;
        }
        Ok(Certs {
            dir: dir.to_owned(),
        })
    }

    /// The path of `file` (a name of the table), as a string for a command line.
    pub fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }

    /// The lender's TLS flags: its certificate and key, and with `client_ca` the
    /// requirement of client certificates signed by the test CA.
    pub fn lender_args(&self, client_ca: bool) -> Vec<String> {
        let mut a = vec![
            "--tls-cert".to_owned(),
            self.path("lender.crt"),
            "--tls-key".into(),
            self.path("lender.key"),
        ];
        if client_ca {
            a.push("--tls-client-ca".into());
            a.push(self.path("ca.crt"));
        }
        a
    }

    /// The compute agent's TLS flags: trust `ca` (a CA file of the table) and, with
    /// `identity` (`borrower` or `stranger`), present that client certificate.
    pub fn borrower_args(&self, ca: &str, identity: Option<&str>) -> Vec<String> {
        let mut a = vec!["--tls-ca".to_owned(), self.path(ca)];
        if let Some(n) = identity {
            a.push("--tls-cert".into());
            a.push(self.path(&format!("{n}.crt")));
            a.push("--tls-key".into());
            a.push(self.path(&format!("{n}.key")));
        }
        a
    }
}
