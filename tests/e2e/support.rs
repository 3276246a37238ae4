//! Shared test harness: processes, registry files and HTTP calls.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tether_core::registry::{Document, EndpointSpec, EndpointsDoc, PortSpec, ServiceDoc};
pub use tether_mesh_up::process::Process;

pub const DOMAIN: &str = "cluster.local";

pub fn tether() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_tether"))
}

/// Runs `tether ARGS` to completion: whether it succeeded, and its stdout
/// followed by its stderr.
pub fn run_tether(args: &[&str]) -> (bool, String) {
    let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tether_mesh_up::process::plaintext_control_plane_without_identity(&mut args);
    let out = std::process::Command::new(tether())
        .args(&args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A scratch directory holding the registry and every process's log.
pub struct Scratch {
    pub dir: tempfile::TempDir,
}

impl Scratch {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("registry")).unwrap();
        Self { dir }
    }

    pub fn registry(&self) -> PathBuf {
        self.dir.path().join("registry")
    }

    pub fn log(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.log"))
    }

    pub fn read_log(&self, name: &str) -> String {
        std::fs::read_to_string(self.log(name)).unwrap_or_default()
    }

    /// Writes a registry file the documented way: temporary file, rename.
    pub fn write(&self, file: &str, text: &str) {
        let tmp = self.registry().join(format!(".{file}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(tmp, self.registry().join(file)).unwrap();
    }

    pub fn remove(&self, file: &str) {
        std::fs::remove_file(self.registry().join(file)).unwrap();
    }

    pub fn service(&self, name: &str, port: u16, opaque: bool) {
        let doc = Document::Service(ServiceDoc::new(
            name,
            "test",
            vec![PortSpec { port, opaque }],
        ));
        self.write(&format!("{name}.yaml"), &doc.to_yaml());
    }

    /// Makes `addr` an endpoint of `service` (file `file`).
    pub fn endpoint(&self, file: &str, service: &str, addr: SocketAddr, meshed: bool) {
        let doc = Document::Endpoints(EndpointsDoc {
            service: service.into(),
            namespace: "test".into(),
            endpoints: vec![EndpointSpec {
                meshed,
                name: Some(file.into()),
                ..EndpointSpec::new(addr)
            }],
        });
        self.write(&format!("{file}.yaml"), &doc.to_yaml());
    }

    /// Starts `tether ARGS`: over TLS to (or on) the control plane when it
    /// has an `--identity`, in plaintext otherwise.
    pub async fn spawn(&self, name: &str, args: &[&str], expect: &[&str]) -> Process {
        self.spawn_exe(tether(), name, args, expect).await
    }

    /// [`Scratch::spawn`] of another executable (the `tether-proxy` binary).
    pub async fn spawn_exe(
        &self,
        exe: &Path,
        name: &str,
        args: &[&str],
        expect: &[&str],
    ) -> Process {
        let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        tether_mesh_up::process::plaintext_control_plane_without_identity(&mut args);
        Process::spawn(exe, name, &args, &self.log(name), expect)
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n--- {name} log ---\n{}", self.read_log(name)))
    }

    /// `tether identity init` into `dir/<name>`; returns that directory.
    pub fn identity_init(&self, name: &str) -> PathBuf {
        let out = self.dir.path().join(name);
        let status = std::process::Command::new(tether())
            .args(["identity", "init", "--out", out.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            status.status.success(),
            "{}",
            String::from_utf8_lossy(&status.stderr)
        );
        out
    }

    /// The proxy flags for `identity`, with a token minted from `id_dir`.
    pub fn identity_args(&self, id_dir: &Path, identity: &str, trust_root: &Path) -> Vec<String> {
        let out = std::process::Command::new(tether())
            .args([
                "identity",
                "token",
                "--dir",
                id_dir.to_str().unwrap(),
                identity,
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let file = self.dir.path().join(format!("{identity}.token"));
        std::fs::write(&file, &out.stdout).unwrap();
        vec![
            "--identity".into(),
            identity.into(),
            "--identity-token-file".into(),
            file.display().to_string(),
            "--trust-root".into(),
            trust_root.join("ca.crt").display().to_string(),
        ]
    }

    /// A control plane that also issues certificates from `id_dir`.
    pub async fn control_with_identity(
        &self,
        name: &str,
        id_dir: &Path,
        leaf_secs: &str,
    ) -> Process {
        self.control_with_identity_and(name, id_dir, &["--identity-leaf-lifetime", leaf_secs])
            .await
    }

    /// As [`Scratch::control_with_identity`], with `extra` flags.
    pub async fn control_with_identity_and(
        &self,
        name: &str,
        id_dir: &Path,
        extra: &[&str],
    ) -> Process {
        let id = id_dir.display().to_string();
        let mut args = vec!["--identity", &id];
        args.extend(extra);
        self.control_at(name, "127.0.0.1:0", &args).await
    }

    /// A control plane on a chosen gRPC address (to restart it in place).
    pub async fn control_at(&self, name: &str, grpc: &str, extra: &[&str]) -> Process {
        let registry = self.registry().display().to_string();
        let mut args = vec![
            "control",
            "--registry",
            &registry,
            "--grpc",
            grpc,
            "--admin",
            "127.0.0.1:0",
        ];
        args.extend(extra);
        self.spawn(name, &args, &["grpc", "admin"]).await
    }

    pub async fn control(&self) -> Process {
        self.control_at("control", "127.0.0.1:0", &[]).await
    }

    /// A sidecar (`tether proxy`); with `app`, also its inbound listener.
    pub async fn proxy(
        &self,
        name: &str,
        control: SocketAddr,
        app: Option<SocketAddr>,
        extra: &[&str],
    ) -> Process {
        self.sidecar(tether(), &["proxy"], name, control, app, extra)
            .await
    }

    /// A sidecar run as `exe COMMAND... FLAGS`: `tether proxy`, or the
    /// `tether-proxy` binary with no command word.
    pub async fn sidecar(
        &self,
        exe: &Path,
        command: &[&str],
        name: &str,
        control: SocketAddr,
        app: Option<SocketAddr>,
        extra: &[&str],
    ) -> Process {
        let control = control.to_string();
        let mut args = command.to_vec();
        args.extend([
            "--control",
            &control,
            "--outbound",
            "127.0.0.1:0",
            "--inbound",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
        ]);
        let app_s = app.map(|a| a.to_string());
        if let Some(a) = &app_s {
            args.extend(["--app", a]);
        }
        args.extend(extra);
        let expect: &[&str] = if app.is_some() {
            &["outbound", "inbound", "admin"]
        } else {
            &["outbound", "admin"]
        };
        self.spawn_exe(exe, name, &args, expect).await
    }

    /// A gateway named `name` admitting clients of `trust_domain`, certified
    /// as `identity` from `ca`, with `extra` flags, once it is ready (holds
    /// its certificate).
    pub async fn gateway(
        &self,
        name: &str,
        control: SocketAddr,
        ca: &Path,
        identity: &str,
        trust_domain: &str,
        extra: &[&str],
    ) -> Process {
        let control = control.to_string();
        let mut args: Vec<String> = [
            "gateway",
            "--control",
            &control,
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--trust-domain",
            trust_domain,
        ]
        .map(String::from)
        .to_vec();
        args.extend(self.identity_args(ca, identity, ca));
        args.extend(extra.iter().map(|a| a.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let gateway = self.spawn(name, &args, &["gateway", "admin"]).await;
        wait_ready(gateway.addr("admin")).await;
        gateway
    }

    pub async fn demo_app(&self, replica: &str, latency_ms: u32) -> Process {
        let latency = latency_ms.to_string();
        self.spawn(
            replica,
            &[
                "demo-app",
                "--listen",
                "127.0.0.1:0",
                "--replica",
                replica,
                "--latency-ms",
                &latency,
            ],
            &["http"],
        )
        .await
    }
}

pub fn authority(service: &str, port: u16) -> String {
    format!("{service}.test.svc.{DOMAIN}:{port}")
}

pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
    pub version: Version,
}

impl Answer {
    pub fn replica(&self) -> &str {
        self.headers
            .get("tether-demo-replica")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    pub fn proxy_error(&self) -> Option<&str> {
        self.headers
            .get("tether-proxy-error")
            .and_then(|v| v.to_str().ok())
    }
}

/// One request over a fresh connection, HTTP/1.1 (Host header) or HTTP/2
/// with prior knowledge (`:authority`).
pub async fn request(
    connect: SocketAddr,
    authority: &str,
    path: &str,
    version: Version,
) -> anyhow::Result<Answer> {
    request_from(None, connect, authority, path, version).await
}

/// As [`request`], from the loopback address `source` when given (any of
/// 127.0.0.0/8 works without setup).
pub async fn request_from(
    source: Option<std::net::IpAddr>,
    connect: SocketAddr,
    authority: &str,
    path: &str,
    version: Version,
) -> anyhow::Result<Answer> {
    let stream = match source {
        None => tokio::net::TcpStream::connect(connect).await?,
        Some(ip) => {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind(SocketAddr::new(ip, 0))?;
            socket.connect(connect).await?
        }
    };
    let io = TokioIo::new(stream);
    let body = Full::new(Bytes::new());
    let rsp = if version == Version::HTTP_2 {
        let (mut s, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
        tokio::spawn(conn);
        let req = http::Request::get(format!("http://{authority}{path}"))
            .version(version)
            .body(body)?;
        s.send_request(req).await?
    } else {
        let (mut s, conn) = hyper::client::conn::http1::handshake(io).await?;
        tokio::spawn(conn);
        let req = http::Request::get(path)
            .header(http::header::HOST, authority)
            .body(body)?;
        s.send_request(req).await?
    };
    let status = rsp.status();
    let version = rsp.version();
    let headers = rsp.headers().clone();
    let body = rsp.into_body().collect().await?.to_bytes();
    Ok(Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
        version,
    })
}

pub async fn get(connect: SocketAddr, authority: &str) -> Answer {
    request(connect, authority, "/", Version::HTTP_11)
        .await
        .unwrap()
}

/// A loopback address nobody listens on (free when this returns). Each
/// call gets its own loopback IP (127.1.x.y), so two tests can never be
/// handed the same address, even when the OS reuses a port number.
pub fn free_port() -> SocketAddr {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let ip = std::net::Ipv4Addr::new(127, 1, (n >> 8) as u8, (n & 0xff) as u8);
    std::net::TcpListener::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
}

pub async fn ready_body(admin: SocketAddr) -> (u16, String) {
    tether_mesh_up::stats::http_get(admin, "/ready")
        .await
        .unwrap()
}

/// Polls `check` until it returns true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Waits (at most `timeout`) until the proxy at `admin` follows `n`
/// endpoints of `authority`. The metric is refreshed every second, and
/// only once a request made the proxy follow the authority.
pub async fn follows(admin: SocketAddr, authority: &str, n: usize, timeout: Duration) -> bool {
    eventually(timeout, || async {
        metric_value(
            &metrics(admin).await,
            "tether_proxy_discovery_endpoints",
            &[("authority", authority)],
        ) == n as f64
    })
    .await
}

pub async fn metrics(admin: SocketAddr) -> String {
    tether_mesh_up::stats::http_get(admin, "/metrics")
        .await
        .unwrap()
        .1
}

/// The value of the one sample of `name` with `labels`, if it is exported.
pub fn metric_sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    tether_core::prom::parse(text)
        .into_iter()
        .find(|s| s.name == name && labels.iter().all(|(k, v)| s.label(k) == Some(v)))
        .map(|s| s.value)
}

pub fn metric_value(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    tether_core::prom::parse(text)
        .into_iter()
        .filter(|s| s.name == name && labels.iter().all(|(k, v)| s.label(k) == Some(v)))
        .map(|s| s.value)
        .sum()
}

/// A mesh of one control plane, a client sidecar, and `replicas` demo apps
/// each behind its own sidecar, registered as endpoints of `web`.
pub struct Mesh {
    pub scratch: Scratch,
    pub control: Process,
    pub client: Process,
    /// Held so the apps live as long as the mesh.
    pub _apps: Vec<Process>,
    pub sidecars: Vec<Process>,
}

impl Mesh {
    pub async fn start(latencies_ms: &[u32]) -> Self {
        let scratch = Scratch::new();
        scratch.service("web", 8080, false);
        let control = scratch.control().await;
        let client = scratch
            .proxy("client", control.addr("grpc"), None, &[])
            .await;
        let mut apps = Vec::new();
        let mut sidecars = Vec::new();
        for (i, latency) in latencies_ms.iter().enumerate() {
            let name = format!("web-{i}");
            let app = scratch.demo_app(&name, *latency).await;
            let sidecar = scratch
                .proxy(
                    &format!("{name}-proxy"),
                    control.addr("grpc"),
                    Some(app.addr("http")),
                    &[],
                )
                .await;
            scratch.endpoint(&name, "web", sidecar.addr("inbound"), true);
            apps.push(app);
            sidecars.push(sidecar);
        }
        Self {
            scratch,
            control,
            client,
            _apps: apps,
            sidecars,
        }
    }

    pub fn outbound(&self) -> SocketAddr {
        self.client.addr("outbound")
    }
}

/// A client TLS config presenting a fresh certificate for `identity`,
/// certified by the control plane at `control` with a token from `ca`, and
/// trusting `ca`'s root.
pub async fn certified_client_tls(
    control: SocketAddr,
    ca: &Path,
    identity: &str,
) -> std::sync::Arc<rustls::ClientConfig> {
    let (store, roots) = certified_store(control, ca, identity).await;
    tether_identity::tls::client_config(store, roots).unwrap()
}

/// A fresh certificate for `identity` (certified by the control plane at
/// `control` with a token from `ca`), and `ca`'s root, for a TLS client or
/// server of the test's own.
pub async fn certified_store(
    control: SocketAddr,
    ca: &Path,
    identity: &str,
) -> (
    std::sync::Arc<tether_identity::tls::CertStore>,
    std::sync::Arc<rustls::RootCertStore>,
) {
    use linkerd2_proxy_api::identity::{identity_client::IdentityClient, CertifyRequest};
    let key = tether_identity::csr::generate(identity).unwrap();
    let token = tether_identity::token::LocalTokens::load(ca)
        .unwrap()
        .issue(identity)
        .into_bytes();
    let rsp = IdentityClient::new(certify_channel(control, ca))
        .certify(CertifyRequest {
            identity: identity.into(),
            token,
            certificate_signing_request: key.csr_der,
        })
        .await
        .unwrap()
        .into_inner();
    let store = tether_identity::tls::CertStore::new();
    let expires = tether_identity::cert::not_after(&rsp.leaf_certificate).unwrap();
    store
        .install(
            rsp.leaf_certificate,
            rsp.intermediate_certificates,
            key.key_pkcs8,
            expires,
        )
        .unwrap();
    let roots = tether_identity::tls::load_roots(&ca.join("ca.crt")).unwrap();
    (store, std::sync::Arc::new(roots))
}

/// A channel to the control plane at `control` for Certify:
/// server-authenticated TLS, verifying the default control-plane identity
/// against `ca`'s root.
pub fn certify_channel(control: SocketAddr, ca: &Path) -> tonic::transport::Channel {
    use tether_identity::control::{channel, default_control_identity, Auth, ControlTls};
    let roots = tether_identity::tls::load_roots(&ca.join("ca.crt")).unwrap();
    let tls = ControlTls::new(
        &default_control_identity(DOMAIN),
        tether_identity::tls::CertStore::new(),
        std::sync::Arc::new(roots),
    )
    .unwrap();
    channel(control, Some((tls, Auth::Server)))
}

/// One HTTP/1.1 GET over TLS to `connect`, verifying the server as
/// `server_identity`.
pub async fn tls_get(
    connect: SocketAddr,
    tls: std::sync::Arc<rustls::ClientConfig>,
    server_identity: &str,
    authority: &str,
) -> anyhow::Result<Answer> {
    tls_get_path(connect, tls, server_identity, authority, "/").await
}

/// As [`tls_get`], for `path`.
pub async fn tls_get_path(
    connect: SocketAddr,
    tls: std::sync::Arc<rustls::ClientConfig>,
    server_identity: &str,
    authority: &str,
    path: &str,
) -> anyhow::Result<Answer> {
    let tcp = tokio::net::TcpStream::connect(connect).await?;
    let name = rustls::pki_types::ServerName::try_from(server_identity.to_string())?;
    let stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await?;
    let (mut s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let req = http::Request::get(path)
        .header(http::header::HOST, authority)
        .body(Full::new(Bytes::new()))?;
    let rsp = s.send_request(req).await?;
    let (status, version, headers) = (rsp.status(), rsp.version(), rsp.headers().clone());
    let body = rsp.into_body().collect().await?.to_bytes();
    Ok(Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
        version,
    })
}

/// Waits (at most 10 s) until the process at `admin` answers `/ready` 200.
pub async fn wait_ready(admin: SocketAddr) {
    assert!(
        eventually(Duration::from_secs(10), || async {
            matches!(
                tether_mesh_up::stats::http_get(admin, "/ready").await,
                Ok((200, _))
            )
        })
        .await,
        "{admin} never became ready"
    );
}

/// A TCP server that echoes every byte and speaks no HTTP.
pub async fn echo_server() -> SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// `tether up MANIFEST` running headless, found through the state file it
/// writes; stopped (SIGTERM, so it cleans up) when dropped.
pub struct LocalMesh {
    pub child: std::process::Child,
    pub state_path: PathBuf,
    pub state: tether_viz::state::MeshState,
    _dir: tempfile::TempDir,
}

impl LocalMesh {
    /// Starts the mesh and waits for its state file: `tether up` writes it
    /// once every proxy is ready (it gives up itself after 20 s a process).
    pub fn start(manifest: &str, extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mesh.yaml");
        std::fs::write(&path, manifest).unwrap();
        let state_path = dir.path().join("state.json");
        let mut child = std::process::Command::new(tether())
            .args(["up", path.to_str().unwrap(), "--duration", "120"])
            .args(["--interval", "60", "--state", state_path.to_str().unwrap()])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let state = loop {
            if let Ok(state) = tether_viz::state::MeshState::load(&state_path) {
                break state;
            }
            if let Some(status) = child.try_wait().unwrap() {
                panic!("tether up exited ({status}) before writing its state");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        Self {
            child,
            state_path,
            state,
            _dir: dir,
        }
    }

    /// Starts `tether COMMAND --state STATE -o json ARGS` and waits for its
    /// first line on stderr (which says it has started), checking that the
    /// line contains `started`.
    pub fn tool(&self, command: &str, args: &[&str], started: &str) -> std::process::Child {
        use std::io::BufRead;
        let state = self.state_path.to_str().unwrap();
        let mut child = std::process::Command::new(tether())
            .args([command, "--state", state, "-o", "json"])
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        stderr.read_line(&mut line).unwrap();
        assert!(line.contains(started), "{line}");
        child
    }

    /// `tether load` at 200 requests per second for 2 s to `service` through
    /// the load generator's proxy: the load generator's report.
    pub fn load(&self, authority: &str) -> serde_json::Value {
        self.load_at(authority, 200, 2)
    }

    /// `tether load` at `rate` requests per second for `seconds`.
    pub fn load_at(&self, authority: &str, rate: u32, seconds: u32) -> serde_json::Value {
        let outbound = self.proxy("loadgen").outbound.unwrap().to_string();
        let (rate, seconds) = (rate.to_string(), seconds.to_string());
        let load = std::process::Command::new(tether())
            .args(["load", "--connect", &outbound, "--authority", authority])
            .args(["--rate", &rate, "--duration", &seconds])
            .args(["--concurrency", "16"])
            .output()
            .unwrap();
        assert!(
            load.status.success(),
            "{}",
            String::from_utf8_lossy(&load.stderr)
        );
        serde_json::from_slice(&load.stdout).unwrap()
    }

    pub fn proxy(&self, workload: &str) -> &tether_viz::state::ProxyState {
        self.state
            .proxies()
            .map(|(_, p)| p)
            .find(|p| p.workload == workload)
            .unwrap_or_else(|| panic!("no proxy {workload} in {:?}", self.state))
    }

    /// SIGTERM, then waits: `tether up` stops its children and removes the
    /// state file.
    pub fn stop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

impl Drop for LocalMesh {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A program the test needs, installed with apt-get (Debian package
/// `package`) when none of `names` is on the PATH; the test fails naming
/// it if that does not work.
///
/// Tests run in parallel and dpkg takes one lock: installs in this process
/// go one at a time, and apt waits for a lock another process holds
/// instead of failing at once.
pub fn installed(names: &[&str], package: &str) -> PathBuf {
    static APT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = APT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let find = || {
        names.iter().find_map(|name| {
            let out = std::process::Command::new("sh")
                .args(["-c", &format!("command -v {name}")])
                .output()
                .ok()?;
            out.status
                .success()
                .then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
        })
    };
    if let Some(path) = find() {
        return path;
    }
    let install = std::process::Command::new("sh")
        .args([
            "-c",
            &format!(
                "export DEBIAN_FRONTEND=noninteractive; \
                 apt-get -o DPkg::Lock::Timeout=300 update && \
                 apt-get -o DPkg::Lock::Timeout=300 install -y --no-install-recommends {package}"
            ),
        ])
        .output()
        .expect("running apt-get");
    find().unwrap_or_else(|| {
        panic!(
            "this test needs {package}, and `apt-get install -y {package}` did not provide it:\n{}",
            String::from_utf8_lossy(&install.stderr)
        )
    })
}
