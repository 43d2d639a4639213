//! TLS for Gangway's HTTP: a listener that serves axum over rustls (the API
//! and the agent's log endpoint, `--tls-cert`/`--tls-key`), and the HTTP
//! client that trusts the cluster's CA (`--ca`) for agents, the CLI and the
//! server's calls to agents and replicas.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
pub use rustls::ServerConfig;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use thiserror::Error;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// Why TLS could not be set up.
#[derive(Debug, Error)]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("{path}: {msg}")]
    Pem {
        /// File.
        path: String,
        /// Why.
        msg: String,
    },
    /// rustls refused the certificate, key or CA.
    #[error("TLS: {0}")]
    Rustls(#[from] rustls::Error),
}

fn pem_err(path: &Path, msg: impl ToString) -> TlsError {
    TlsError::Pem {
        path: path.display().to_string(),
        msg: msg.to_string(),
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A server configuration from a PEM certificate chain and private key.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| pem_err(cert, e))?
        .collect::<Result<_, _>>()
        .map_err(|e| pem_err(cert, e))?;
    if certs.is_empty() {
        return Err(pem_err(cert, "no certificate in the file"));
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| pem_err(key, e))?;
    let cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    Ok(Arc::new(cfg))
}

/// A client configuration that trusts only the CA certificates in `ca`.
pub fn client_config(ca: &Path) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).map_err(|e| pem_err(ca, e))? {
        roots.add(c.map_err(|e| pem_err(ca, e))?)?;
    }
    if roots.is_empty() {
        return Err(pem_err(ca, "no CA certificate in the file"));
    }
    let cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(cfg))
}

static CLIENT: OnceLock<ureq::Agent> = OnceLock::new();

/// Makes [`http`] trust the CA in `ca` (once per process; later calls keep
/// the first CA). Without it, `https` URLs are refused: Gangway never falls
/// back to the system's public roots for its own cluster.
pub fn trust_ca(ca: &Path) -> Result<(), TlsError> {
    let cfg = client_config(ca)?;
    let _ = CLIENT.set(
        ureq::AgentBuilder::new()
            .tls_config(cfg)
            .redirects(0)
            .build(),
    );
    Ok(())
}

/// The process's HTTP client: plain HTTP, and HTTPS verified against the
/// CA given to [`trust_ca`].
pub fn http() -> ureq::Agent {
    CLIENT
        .get()
        .cloned()
        .unwrap_or_else(|| ureq::AgentBuilder::new().redirects(0).build())
}

/// A TCP listener that hands axum TLS streams; handshakes run in their own
/// tasks (bounded by a timeout), so a slow or silent client delays nobody.
pub struct TlsListener {
    addr: SocketAddr,
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
}

/// How long a client may take to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

impl TlsListener {
    /// Serves TLS on `listener` with `cfg`.
    pub fn new(listener: TcpListener, cfg: Arc<rustls::ServerConfig>) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let acceptor = TlsAcceptor::from(cfg);
        let (tx, ready) = mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                let (tcp, peer) = match listener.accept().await {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::debug!("accept: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if tx.is_closed() {
                    return;
                }
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(s)) => {
                            let _ = tx.send((s, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!("TLS handshake with {peer}: {e}"),
                        Err(_) => tracing::debug!("TLS handshake with {peer} timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { addr, ready })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(x) => x,
            // The accept task ended: nothing will ever connect again.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.addr)
    }
}

/// Serves `router` on `listener`, over TLS when `tls` is given.
pub async fn serve(
    listener: TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    router: axum::Router,
) -> std::io::Result<()> {
    match tls {
        Some(cfg) => axum::serve(TlsListener::new(listener, cfg)?, router).await,
        None => axum::serve(listener, router).await,
    }
}
