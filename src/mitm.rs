//! (temporary stub)
#![allow(missing_docs)]
use std::path::{Path, PathBuf};
#[derive(Debug, thiserror::Error)]
#[error("x")]
pub struct MitmError;
pub struct CaFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}
pub fn generate_ca(_d: &Path) -> Result<CaFiles, MitmError> {
    Err(MitmError)
}
pub struct CertAuthority;
impl CertAuthority {
    pub fn load(_c: &Path, _k: &Path) -> Result<Self, MitmError> {
        Err(MitmError)
    }
}
pub struct Interceptor;
impl Interceptor {
    pub fn new(_ca: CertAuthority, _c: usize, _v: std::time::Duration) -> Self {
        Interceptor
    }
    pub async fn accept<IO>(
        &self,
        io: IO,
        _h: &str,
    ) -> Result<(tokio_rustls::server::TlsStream<IO>, String), MitmError>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let _ = io;
        Err(MitmError)
    }
}
