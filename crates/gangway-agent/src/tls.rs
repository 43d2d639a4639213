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
    /// This process already trusts another CA: one CA per process, so a
    /// second one is refused rather than silently ignored.
    #[error("{path}: this process already trusts the CA in {first}")]
    OtherCa {
        /// The CA asked for.
        path: String,
        /// The CA already trusted.
        first: String,
    },
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

static CLIENT: OnceLock<(std::path::PathBuf, ureq::Agent)> = OnceLock::new();

/// Makes [`http`] trust the CA in `ca`, once per process: trusting the same
/// file again is a no-op, another one is refused ([`TlsError::OtherCa`]).
/// Without it, `https` URLs are refused: Gangway never falls back to the
/// system's public roots for its own cluster.
pub fn trust_ca(ca: &Path) -> Result<(), TlsError> {
    let same = |first: &Path| {
        first == ca || std::fs::canonicalize(first).ok() == std::fs::canonicalize(ca).ok()
    };
    if let Some((first, _)) = CLIENT.get() {
        return if same(first) {
            Ok(())
        } else {
            Err(TlsError::OtherCa {
                path: ca.display().to_string(),
                first: first.display().to_string(),
            })
        };
    }
    let cfg = client_config(ca)?;
    let agent = ureq::AgentBuilder::new()
        .tls_config(cfg)
        .redirects(0)
        .build();
    let _ = CLIENT.set((ca.to_path_buf(), agent));
    match CLIENT.get() {
        Some((first, _)) if !same(first) => Err(TlsError::OtherCa {
            path: ca.display().to_string(),
            first: first.display().to_string(),
        }),
        _ => Ok(()),
    }
}

/// The CA file [`http`] trusts, if one was given.
pub fn trusted_ca() -> Option<&'static Path> {
    CLIENT.get().map(|(p, _)| p.as_path())
}

/// When `error` (an HTTP client's error text) says the peer's certificate
/// failed verification, a sentence naming the CA this process trusts (or
/// that none was given) and how to pass the right one (`how`); else `None`.
pub fn certificate_hint(error: &str, how: &str) -> Option<String> {
    const SIGNS: [&str; 4] = [
        "invalid peer certificate",
        "UnknownIssuer",
        "BadSignature",
        "NotValidForName",
    ];
    if !SIGNS.iter().any(|s| error.contains(s)) {
        return None;
    }
    Some(match trusted_ca() {
        Some(ca) => format!(
            "the server's TLS certificate is not signed by the CA in {} (the CA this process trusts); {how}",
            ca.display()
        ),
        None => format!(
            "the server's TLS certificate cannot be verified: no CA was given for it; {how}"
        ),
    })
}

/// The process's HTTP client: plain HTTP, and HTTPS verified against the
/// CA given to [`trust_ca`].
pub fn http() -> ureq::Agent {
    CLIENT
        .get()
        .map(|(_, a)| a.clone())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Two unrelated self-signed CA certificates (P-256, made with openssl).
    const CA_A: &str = "-----BEGIN CERTIFICATE-----\n\
MIIBfzCCASWgAwIBAgIUSxOINRfLlN6bwzh7qOemJWA245IwCgYIKoZIzj0EAwIw\n\
FDESMBAGA1UEAwwJdGVzdCBDQSBhMCAXDTI2MTIwODAwNDkyMloYDzIxMjYxMTE0\n\
MDA0OTIyWjAUMRIwEAYDVQQDDAl0ZXN0IENBIGEwWTATBgcqhkjOPQIBBggqhkjO\n\
PQMBBwNCAASCwBmTR4a74RKDR5qfFI/3vnET7O2AcA/4224yp8+SVQAwPqVTI7CA\n\
0r0y7CFTlO8mkzrt46NaZB36VLnOrl9mo1MwUTAdBgNVHQ4EFgQUVEFp/f6TEhc1\n\
U3u5N4btu5ST1IQwHwYDVR0jBBgwFoAUVEFp/f6TEhc1U3u5N4btu5ST1IQwDwYD\n\
VR0TAQH/BAUwAwEB/zAKBggqhkjOPQQDAgNIADBFAiEApvvLSeI4Ps0WodmYG4hT\n\
QSg2wc5pKiz2rzvHWU3Dc/8CICw84Xf7JFYQxkHV3J+ika2EV7duHeHW2K9GWKfx\n\
wYcL\n\
-----END CERTIFICATE-----\n";
    const CA_B: &str = "-----BEGIN CERTIFICATE-----\n\
MIIBfzCCASWgAwIBAgIUOL9c36RBoeC84/L9V2iSaA2AJ2swCgYIKoZIzj0EAwIw\n\
FDESMBAGA1UEAwwJdGVzdCBDQSBiMCAXDTI2MTIwODAwNDkyMloYDzIxMjYxMTE0\n\
MDA0OTIyWjAUMRIwEAYDVQQDDAl0ZXN0IENBIGIwWTATBgcqhkjOPQIBBggqhkjO\n\
PQMBBwNCAARL4yMvZVC8Xu0rLkYIlnRL8l3MwwzSXv8Y8f08zScRDEJhYS9IQUoF\n\
DEefDlh65hJLCH60tRQlUkZJWuz4XmYAo1MwUTAdBgNVHQ4EFgQUX48sYycqpNVm\n\
hG/yafQQl2745CcwHwYDVR0jBBgwFoAUX48sYycqpNVmhG/yafQQl2745CcwDwYD\n\
VR0TAQH/BAUwAwEB/zAKBggqhkjOPQQDAgNIADBFAiEA0jGFLDCm5Zi9mUUIf9E4\n\
F6DdbmZ6G884AbNo8XOQcWoCIAtVRhFLPccOMsM5zKzWzsHY5hSDBgJNn5EsUkqf\n\
7N9e\n\
-----END CERTIFICATE-----\n";

    /// The process trusts one CA: the same file again is accepted, another
    /// is refused (naming both), and certificate errors then name the CA.
    /// The only test in this crate that sets the process's CA.
    #[test]
    fn one_ca_per_process_and_certificate_errors_name_it() {
        let dir = std::env::temp_dir().join(format!("gangway-tls-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let (a, b) = (dir.join("a.pem"), dir.join("b.pem"));
        std::fs::write(&a, CA_A).expect("a");
        std::fs::write(&b, CA_B).expect("b");
        assert!(
            certificate_hint("invalid peer certificate: UnknownIssuer", "pass it")
                .is_some_and(|h| h.contains("no CA was given") && h.ends_with("; pass it"))
        );
        trust_ca(&a).expect("first CA");
        trust_ca(&a).expect("the same CA again");
        let e = trust_ca(&b).expect_err("a second CA");
        assert!(matches!(e, TlsError::OtherCa { .. }), "{e}");
        assert!(e.to_string().contains("already trusts the CA in"), "{e}");
        assert_eq!(trusted_ca(), Some(a.as_path()));
        let hint = certificate_hint("invalid peer certificate: BadSignature", "pass it")
            .expect("a certificate error");
        assert!(
            hint.contains(&format!("not signed by the CA in {}", a.display())),
            "{hint}"
        );
        assert_eq!(certificate_hint("connection refused", "pass it"), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
