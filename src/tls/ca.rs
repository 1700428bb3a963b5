//! The interception CA on disk.
//!
//! This module owns creating a CA ([`generate_ca`] writes `ca.pem` + `ca.key` with safe
//! modes, never overwriting), loading one ([`CertAuthority::load`]: PEM and PKCS#8 read,
//! the certificate checked to be a CA whose key is the one given, then a self-test that a
//! leaf it signs verifies with rustls), and signing leaves with it
//! (`CertAuthority::mint`, whose content `leaf` decides).
//!
//! The certificate is taken apart by rcgen ([`Issuer::from_ca_cert_der`], which rebuilds
//! the subject, key identifier and key usages to sign with) and by `x509-parser` for
//! what rcgen does not check: basicConstraints and the public key.

use std::fmt;
use std::fs::{self, DirBuilder, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, PublicKeyData,
};
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use x509_parser::extensions::ParsedExtension;

use super::MitmError;
use super::leaf::{self, Host};

/// Common name of the CA written by [`generate_ca`].
const CA_COMMON_NAME: &str = "sluice interception CA";
/// Lifetime of the CA written by [`generate_ca`] (about 10 years).
const CA_VALIDITY: Duration = Duration::from_secs(3650 * 24 * 3600);
/// Host name used to check, at load time, that the CA can sign verifiable leaves.
const PROBE_HOST: &str = "sluice-ca-self-test.invalid";

/// Paths written by [`generate_ca`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaFiles {
    /// The CA certificate (`ca.pem`); this is what clients must trust.
    pub cert: PathBuf,
    /// The CA private key (`ca.key`, PKCS#8 PEM, mode 0600); keep it secret.
    pub key: PathBuf,
}

/// Writes a new interception CA into `dir`, creating `dir` (mode 0700) if needed.
///
/// Writes `ca.pem` (the certificate, mode 0644) and `ca.key` (PKCS#8 PEM private key,
/// created with mode 0600). Refuses with [`MitmError::CaExists`] if either file already
/// exists, writing nothing. The CA has CN "sluice interception CA", `basicConstraints`
/// `cA=true, pathLen=0`, key usages keyCertSign + cRLSign, a fresh ECDSA P-256 key and
/// a validity of about 10 years.
pub fn generate_ca(dir: &Path) -> Result<CaFiles, MitmError> {
    let files = CaFiles {
        cert: dir.join("ca.pem"),
        key: dir.join("ca.key"),
    };
    for path in [&files.cert, &files.key] {
        // symlink_metadata: a dangling symlink counts as existing too.
        match fs::symlink_metadata(path) {
            Ok(_) => return Err(MitmError::CaExists { path: path.clone() }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(MitmError::Io {
                    action: "check for an existing CA file",
                    path: path.clone(),
                    source,
                });
            }
        }
    }

    // Make everything before touching the disk.
    let (cert_pem, key_pem) = new_ca_pem()?;

    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| MitmError::Io {
            action: "create CA directory",
            path: dir.to_path_buf(),
            source,
        })?;
    write_new_file(&files.key, key_pem.as_bytes(), 0o600)?;
    if let Err(e) = write_new_file(&files.cert, cert_pem.as_bytes(), 0o644) {
        let _ = fs::remove_file(&files.key);
        return Err(e);
    }
    Ok(files)
}

/// A new self-signed CA: (certificate PEM, PKCS#8 key PEM).
fn new_ca_pem() -> Result<(String, String), MitmError> {
    let fail = |e: rcgen::Error| MitmError::CaGeneration {
        reason: e.to_string(),
    };
    let key = KeyPair::generate().map_err(fail)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_COMMON_NAME);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    super::set_validity(&mut params, CA_VALIDITY)
        .map_err(|reason| MitmError::CaGeneration { reason })?;
    let cert = params.self_signed(&key).map_err(fail)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Creates `path` (which must not exist) with `mode` and writes `contents`.
fn write_new_file(path: &Path, contents: &[u8], mode: u32) -> Result<(), MitmError> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|source| match source.kind() {
            io::ErrorKind::AlreadyExists => MitmError::CaExists {
                path: path.to_path_buf(),
            },
            _ => MitmError::Io {
                action: "create",
                path: path.to_path_buf(),
                source,
            },
        })?;
    let written = file
        // The umask may only have removed bits; make the mode exact.
        .set_permissions(fs::Permissions::from_mode(mode))
        .and_then(|()| file.write_all(contents))
        .and_then(|()| file.sync_all());
    if let Err(source) = written {
        drop(file);
        let _ = fs::remove_file(path);
        return Err(MitmError::Io {
            action: "write",
            path: path.to_path_buf(),
            source,
        });
    }
    Ok(())
}

/// A loaded CA able to sign leaf certificates.
pub struct CertAuthority {
    /// Subject, key identifier and signing key of the CA.
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate, sent after each leaf.
    cert_der: CertificateDer<'static>,
    /// Where the certificate was loaded from (named in handshake errors).
    cert_path: PathBuf,
    /// Whether leaves carry an authorityKeyIdentifier (the CA has a subjectKeyIdentifier).
    authority_key_id: bool,
}

impl fmt::Debug for CertAuthority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertAuthority")
            .field("cert_path", &self.cert_path)
            .finish_non_exhaustive()
    }
}

/// What [`CertAuthority::load`] checks that rcgen's reader does not.
struct CaFacts {
    /// basicConstraints `cA` is set.
    is_ca: bool,
    /// Encoded SubjectPublicKeyInfo.
    spki: Vec<u8>,
    /// Encoded subject Name, which leaves must carry as their issuer byte for byte.
    subject: Vec<u8>,
    /// The certificate has a subjectKeyIdentifier.
    has_ski: bool,
    /// Every subject component holds exactly one attribute (all rcgen can rebuild;
    /// rcgen panics on an empty one).
    single_valued_subject: bool,
}

impl CaFacts {
    /// Reads the facts from a DER certificate; the error says why it is not X.509.
    fn read(der: &[u8]) -> Result<Self, String> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| e.to_string())?;
        let has_ski = cert.iter_extensions().any(|ext| {
            matches!(
                ext.parsed_extension(),
                ParsedExtension::SubjectKeyIdentifier(_)
            )
        });
        let is_ca = cert
            .basic_constraints()
            .map_err(|e| e.to_string())?
            .is_some_and(|bc| bc.value.ca);
        Ok(Self {
            is_ca,
            spki: cert.public_key().raw.to_vec(),
            subject: cert.subject().as_raw().to_vec(),
            has_ski,
            single_valued_subject: cert.subject().iter().all(|rdn| rdn.iter().count() == 1),
        })
    }
}

impl CertAuthority {
    /// Loads a PEM CA certificate and its PEM private key (PKCS#8, e.g. from [`generate_ca`]).
    ///
    /// Besides parsing, checks that the certificate is a CA, that the key belongs to it,
    /// and that a test leaf it signs verifies against it; any failure names the file and
    /// what to do. CAs not made by sluice work too, provided their key is PKCS#8
    /// (ECDSA P-256/P-384, Ed25519 or RSA) and their subject uses single-valued,
    /// non-repeated attributes.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, MitmError> {
        let cert_der = read_cert(cert)?;
        let key_pair = read_key(key)?;
        warn_if_exposed(key);

        let bad_ca = |reason: String| MitmError::BadCa {
            path: cert.to_path_buf(),
            reason,
        };
        let facts = CaFacts::read(&cert_der).map_err(|reason| MitmError::BadPem {
            path: cert.to_path_buf(),
            expected: "PEM CA certificate",
            reason: format!("the CERTIFICATE block is not a valid X.509 certificate ({reason})"),
        })?;
        if !facts.is_ca {
            return Err(bad_ca(
                "it is not a CA certificate (basicConstraints cA is not set) — create one with `sluice ca init --dir DIR` and point tls.ca_cert / tls.ca_key at it".to_owned(),
            ));
        }
        if facts.spki != key_pair.subject_public_key_info() {
            return Err(bad_ca(format!(
                "the private key in {} does not belong to this certificate — load the key that was generated with it",
                key.display()
            )));
        }
        if !facts.single_valued_subject {
            return Err(bad_ca(
                "sluice cannot reproduce its subject name (multi-valued or empty name components are not supported)".to_owned(),
            ));
        }
        let issuer = Issuer::from_ca_cert_der(&cert_der, key_pair).map_err(|e| {
            bad_ca(format!(
                "sluice cannot reproduce its subject name ({e}) — only single-valued attributes in common string types are supported"
            ))
        })?;
        let ca = Self {
            issuer,
            cert_der,
            cert_path: cert.to_path_buf(),
            authority_key_id: facts.has_ski,
        };
        ca.self_test(&facts.subject).map_err(bad_ca)?;
        Ok(ca)
    }

    /// The CA certificate in DER (what clients must trust).
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// The file the CA certificate was loaded from.
    pub fn cert_path(&self) -> &Path {
        &self.cert_path
    }

    /// Signs a leaf for [`PROBE_HOST`] and checks that rustls' verifier accepts it.
    fn self_test(&self, subject_der: &[u8]) -> Result<(), String> {
        let provider = Arc::new(super::crypto_provider());
        let host = Host::parse(PROBE_HOST)?;
        let (chain, _key) = self.mint(&host, Duration::from_secs(3600))?;
        let leaf = chain
            .first()
            .ok_or_else(|| "no certificate was minted".to_owned())?;
        let (_, parsed) = x509_parser::parse_x509_certificate(leaf).map_err(|e| e.to_string())?;
        if parsed.issuer().as_raw() != subject_der {
            return Err(
                "sluice cannot reproduce its subject name byte for byte (unusual string encoding or repeated attributes)"
                    .to_owned(),
            );
        }
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(self.cert_der.clone())
            .map_err(|e| format!("rustls cannot use it as a trust anchor ({e})"))?;
        let verifier =
            rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| format!("rustls cannot use it as a trust anchor ({e})"))?;
        let name = ServerName::try_from(PROBE_HOST).map_err(|e| e.to_string())?;
        verifier
            .verify_server_cert(leaf, &[], &name, &[], UnixTime::now())
            .map_err(|e| format!("a test certificate it signed does not verify ({e})"))?;
        Ok(())
    }

    /// Mints a leaf for `host` with its own fresh key: ([leaf, CA], leaf key).
    pub(super) fn mint(
        &self,
        host: &Host,
        validity: Duration,
    ) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), String> {
        let (leaf, key) = leaf::mint(host, validity, &self.issuer, self.authority_key_id)?;
        Ok((vec![leaf, self.cert_der.clone()], key))
    }
}

fn read_error(action: &'static str, path: &Path, source: io::Error) -> MitmError {
    match source.kind() {
        io::ErrorKind::NotFound => MitmError::CaMissing {
            path: path.to_path_buf(),
        },
        _ => MitmError::Io {
            action,
            path: path.to_path_buf(),
            source,
        },
    }
}

/// Reads the first CERTIFICATE block of a PEM file.
fn read_cert(path: &Path) -> Result<CertificateDer<'static>, MitmError> {
    let pem = fs::read(path).map_err(|source| read_error("read CA certificate", path, source))?;
    let bad = |reason: String| MitmError::BadPem {
        path: path.to_path_buf(),
        expected: "PEM CA certificate",
        reason,
    };
    match rustls_pemfile::certs(&mut pem.as_slice()).next() {
        Some(Ok(cert)) => Ok(cert),
        Some(Err(e)) => Err(bad(format!("malformed PEM ({e})"))),
        None => Err(bad(
            "no `-----BEGIN CERTIFICATE-----` block found — create a CA with `sluice ca init --dir DIR` and point tls.ca_cert at its ca.pem".to_owned(),
        )),
    }
}

/// Whether a key file may be read by others than sluice: by others, or by its group,
/// except where sluice reads it only through that group: a file of another user whose
/// group is sluice's own effective group, as Kubernetes mounts a secret for a non-root
/// pod (root's, the pod's `fsGroup`, mode 0440), where sluice could not `chmod` it.
/// `file` and `own` are `(uid, gid)`; `own` is `None` where it cannot be told.
fn exposed(mode: u32, file: (u32, u32), own: Option<(u32, u32)>) -> bool {
    let through_own_group = own.is_some_and(|(uid, gid)| file.0 != uid && file.1 == gid);
    mode & 0o007 != 0 || (mode & 0o070 != 0 && !through_own_group)
}

/// The process's effective user and group: those of `/proc/self` (Linux).
fn own_ids() -> Option<(u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    fs::metadata("/proc/self").ok().map(|m| (m.uid(), m.gid()))
}

/// Reads the private key of a PEM file.
/// Warns when the CA key file may be read by others than sluice ([`exposed`]): whoever
/// reads it can impersonate any site to the senders that trust the CA. A warning, not
/// an error: a key may be shared with a group on purpose.
fn warn_if_exposed(key: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = fs::metadata(key) else {
        return;
    };
    let mode = meta.permissions().mode() & 0o777;
    if exposed(mode, (meta.uid(), meta.gid()), own_ids()) {
        tracing::warn!(
            path = %key.display(),
            mode = format!("{mode:o}"),
            "tls.ca_key {} is readable by its group or others (mode {mode:o}): anyone who \
             reads it can impersonate any site to your senders; `chmod 600` it (a Kubernetes \
             secret: defaultMode 0440 with the pod's fsGroup set to sluice's group)",
            key.display()
        );
    }
}

fn read_key(path: &Path) -> Result<KeyPair, MitmError> {
    let pem = fs::read(path).map_err(|source| read_error("read CA private key", path, source))?;
    let bad = |reason: String| MitmError::BadPem {
        path: path.to_path_buf(),
        expected: "PEM CA private key",
        reason,
    };
    let key = match rustls_pemfile::private_key(&mut pem.as_slice()) {
        Ok(Some(key)) => key,
        Ok(None) => {
            return Err(bad(
                "no unencrypted `-----BEGIN PRIVATE KEY-----` block found — create a CA with `sluice ca init --dir DIR` and point tls.ca_key at its ca.key".to_owned(),
            ));
        }
        Err(e) => return Err(bad(format!("malformed PEM ({e})"))),
    };
    if !matches!(key, PrivateKeyDer::Pkcs8(_)) {
        return Err(bad(format!(
            "the key is not PKCS#8 — convert it with `openssl pkcs8 -topk8 -nocrypt -in {}`",
            path.display()
        )));
    }
    KeyPair::try_from(&key).map_err(|e| bad(format!("unsupported or corrupt key ({e})")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key sluice owns is exposed by any group or other bit; one it reads only
    /// through its own group (a Kubernetes secret with `fsGroup`) is not, unless
    /// others may read it too.
    #[test]
    fn a_key_read_through_sluices_own_group_is_not_exposed() {
        let sluice = Some((10001, 10001));
        assert!(!exposed(0o600, (10001, 10001), sluice));
        assert!(exposed(0o640, (10001, 10001), sluice));
        assert!(!exposed(0o440, (0, 10001), sluice));
        assert!(exposed(0o444, (0, 10001), sluice));
        assert!(exposed(0o440, (0, 20), sluice));
        assert!(exposed(0o440, (0, 10001), None));
    }

    #[test]
    fn generate_ca_writes_files_and_refuses_to_overwrite() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("nested/ca");
        let files = generate_ca(&dir).unwrap();
        assert_eq!(files.cert, dir.join("ca.pem"));
        assert_eq!(files.key, dir.join("ca.key"));
        let cert = fs::read_to_string(&files.cert).unwrap();
        let key = fs::read_to_string(&files.key).unwrap();
        assert!(cert.starts_with("-----BEGIN CERTIFICATE-----"), "{cert}");
        assert!(key.starts_with("-----BEGIN PRIVATE KEY-----"));
        let mode = fs::metadata(&files.key).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);

        let err = generate_ca(&dir).unwrap_err();
        assert!(matches!(err, MitmError::CaExists { .. }), "{err}");
        assert!(err.to_string().contains("ca.pem"), "{err}");
        assert_eq!(fs::read_to_string(&files.cert).unwrap(), cert);
        assert_eq!(fs::read_to_string(&files.key).unwrap(), key);

        // Only the key left: still refused, nothing written.
        fs::remove_file(&files.cert).unwrap();
        let err = generate_ca(&dir).unwrap_err();
        assert!(err.to_string().contains("ca.key"), "{err}");
        assert!(!files.cert.exists());
        assert_eq!(fs::read_to_string(&files.key).unwrap(), key);
    }

    #[test]
    fn load_round_trips() {
        let tmp = tempfile::tempdir().unwrap();
        let files = generate_ca(tmp.path()).unwrap();
        let ca = CertAuthority::load(&files.cert, &files.key).unwrap();
        let pem = fs::read(&files.cert).unwrap();
        let from_file = rustls_pemfile::certs(&mut pem.as_slice())
            .next()
            .unwrap()
            .unwrap();
        assert_eq!(ca.cert_der(), &from_file);
        assert_eq!(ca.cert_path(), files.cert);
        let facts = CaFacts::read(ca.cert_der()).unwrap();
        assert!(facts.is_ca);
        assert!(facts.has_ski);
        assert!(ca.authority_key_id);
        let (_, parsed) = x509_parser::parse_x509_certificate(ca.cert_der()).unwrap();
        let cn = parsed.subject().iter_common_name().next().unwrap();
        assert_eq!(cn.as_str().unwrap(), CA_COMMON_NAME);
    }

    #[test]
    fn minted_leaves_are_signed_by_the_ca_and_not_cas() {
        let tmp = tempfile::tempdir().unwrap();
        let files = generate_ca(tmp.path()).unwrap();
        let ca = CertAuthority::load(&files.cert, &files.key).unwrap();
        let host = Host::parse("api.example.com").unwrap();
        let (chain, _key) = ca.mint(&host, Duration::from_secs(3600)).unwrap();
        assert_eq!(chain.len(), 2);
        assert_eq!(&chain[1], ca.cert_der());
        let leaf = CaFacts::read(&chain[0]).unwrap();
        let ca_facts = CaFacts::read(ca.cert_der()).unwrap();
        assert!(!leaf.is_ca);
        assert_ne!(leaf.spki, ca_facts.spki, "leaf must have its own key");
        let (_, parsed) = x509_parser::parse_x509_certificate(&chain[0]).unwrap();
        assert_eq!(parsed.issuer().as_raw(), ca_facts.subject.as_slice());
    }

    #[test]
    fn load_errors_name_the_file() {
        let tmp = tempfile::tempdir().unwrap();
        let files = generate_ca(&tmp.path().join("ca")).unwrap();
        let missing = tmp.path().join("missing.pem");
        let garbage = tmp.path().join("garbage.pem");
        fs::write(&garbage, "this is not PEM\n").unwrap();

        for (cert, key, named) in [
            (&missing, &files.key, &missing),
            (&garbage, &files.key, &garbage),
            (&files.cert, &missing, &missing),
            (&files.cert, &garbage, &garbage),
            // Swapped: the key file holds no key.
            (&files.key, &files.cert, &files.key),
        ] {
            let err = CertAuthority::load(cert, key).unwrap_err();
            let msg = err.to_string();
            if named == &missing {
                assert!(matches!(err, MitmError::CaMissing { .. }), "{err}");
                assert!(msg.contains("sluice ca init"), "{msg}");
            }
            assert!(
                msg.contains(&named.display().to_string()),
                "{msg} should name {}",
                named.display()
            );
        }

        // A key that does not belong to the certificate.
        let other = generate_ca(&tmp.path().join("other")).unwrap();
        let err = CertAuthority::load(&files.cert, &other.key).unwrap_err();
        assert!(matches!(err, MitmError::BadCa { .. }), "{err}");
        assert!(err.to_string().contains("does not belong"), "{err}");

        // A leaf certificate is not a CA.
        let key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["leaf.example".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let leaf_pem = tmp.path().join("leaf.pem");
        let leaf_key = tmp.path().join("leaf.key");
        fs::write(&leaf_pem, leaf.pem()).unwrap();
        fs::write(&leaf_key, key.serialize_pem()).unwrap();
        let err = CertAuthority::load(&leaf_pem, &leaf_key).unwrap_err();
        assert!(err.to_string().contains("not a CA"), "{err}");

        // A CERTIFICATE block whose content is not X.509.
        let junk = tmp.path().join("junk.pem");
        fs::write(
            &junk,
            "-----BEGIN CERTIFICATE-----\nMAMCAQE=\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let err = CertAuthority::load(&junk, &files.key).unwrap_err();
        assert!(matches!(err, MitmError::BadPem { .. }), "{err}");
        assert!(err.to_string().contains("not a valid X.509"), "{err}");
        assert!(err.to_string().contains("junk.pem"), "{err}");
    }

    /// Writes a self-signed CA with `dn` and loads it.
    fn load_foreign(dn: DistinguishedName) -> Result<CertAuthority, MitmError> {
        let tmp = tempfile::tempdir().unwrap();
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign];
        params.key_identifier_method = rcgen::KeyIdMethod::PreSpecified(vec![1, 2, 3, 4]);
        let cert = params.self_signed(&key).unwrap();
        let cert_path = tmp.path().join("corp.pem");
        let key_path = tmp.path().join("corp.key");
        fs::write(&cert_path, cert.pem()).unwrap();
        fs::write(&key_path, key.serialize_pem()).unwrap();
        CertAuthority::load(&cert_path, &key_path)
    }

    #[test]
    fn loads_a_foreign_ca_with_a_richer_subject() {
        let mut dn = DistinguishedName::new();
        dn.push(
            DnType::CountryName,
            rcgen::DnValue::PrintableString("DE".try_into().unwrap()),
        );
        dn.push(DnType::OrganizationName, "Ümlaut GmbH");
        dn.push(DnType::CommonName, "Corp Root");
        let ca = load_foreign(dn).unwrap();
        let host = Host::parse("x.example").unwrap();
        ca.mint(&host, Duration::from_secs(3600)).unwrap();
    }

    #[test]
    fn a_subject_sluice_cannot_reproduce_is_refused() {
        // rcgen keeps one value per attribute type, so a repeated one cannot round-trip:
        // the self-test sees the leaf's issuer differ from the CA's subject.
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationalUnitName, "ops");
        dn.push(DnType::CommonName, "Corp Root");
        let mut params = CertificateParams::default();
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        // Rewrite the OU's type as CN (same length): the subject now repeats CN. The
        // self-signature breaks, which sluice does not check for a trust anchor.
        let mut repeated = cert.der().to_vec();
        let ou = [0x06, 0x03, 0x55, 0x04, 0x0b];
        let at = repeated.windows(ou.len()).rposition(|w| w == ou).unwrap(); // subject, after issuer
        repeated[at + 4] = 0x03;
        let tmp = tempfile::tempdir().unwrap();
        let cert_path = tmp.path().join("rep.pem");
        let key_path = tmp.path().join("rep.key");
        let b64 = {
            use base64::Engine;
            base64::engine::general_purpose::STANDARD.encode(&repeated)
        };
        fs::write(
            &cert_path,
            format!("-----BEGIN CERTIFICATE-----\n{b64}\n-----END CERTIFICATE-----\n"),
        )
        .unwrap();
        fs::write(&key_path, key.serialize_pem()).unwrap();
        let err = CertAuthority::load(&cert_path, &key_path).unwrap_err();
        assert!(matches!(err, MitmError::BadCa { .. }), "{err}");
        assert!(
            err.to_string().contains("reproduce its subject name"),
            "{err}"
        );
    }
}
