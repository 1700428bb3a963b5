//! (temporary stub)
#![allow(missing_docs)]
#[derive(Debug, thiserror::Error)]
#[error("x")]
pub struct UpstreamTlsError;
pub fn client_config(_e: &[std::path::PathBuf]) -> Result<rustls::ClientConfig, UpstreamTlsError> {
    let p = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(p)
        .with_safe_default_protocol_versions()
        .map_err(|_| UpstreamTlsError)?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth())
}
pub fn describe_failure(err: &(dyn std::error::Error + 'static)) -> String {
    err.to_string()
}
