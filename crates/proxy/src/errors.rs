//! Errors the proxy answers requests with. Each names the condition, and
//! becomes the `tether-proxy-error` header of the response.

use std::net::SocketAddr;

use http::StatusCode;

#[derive(Debug, Clone, thiserror::Error)]
pub enum ProxyError {
    #[error("request names no target: send a Host header or an absolute URI")]
    NoAuthority,
    #[error("reading the request body failed: {0}")]
    RequestBody(String),
    #[error("invalid authority {authority:?}: {reason}")]
    InvalidAuthority { authority: String, reason: String },
    #[error("unknown service {0}")]
    UnknownService(String),
    #[error("control plane unreachable")]
    ControlPlaneUnreachable,
    #[error("discovery of {authority} failed: message too large ({detail})")]
    DiscoveryMessageTooLarge { authority: String, detail: String },
    #[error("discovery subscription limit reached: this proxy follows at most {limit} authorities (--max-discovery-subscriptions) and none is idle")]
    DiscoveryLimit { limit: usize },
    #[error("service in fail-fast")]
    FailFast,
    #[error("too many requests waiting for an endpoint of {authority}")]
    QueueFull { authority: String },
    #[error("endpoint {addr} unreachable: {reason}")]
    Connect { addr: SocketAddr, reason: String },
    #[error("upstream {addr} failed: {reason}")]
    Upstream { addr: SocketAddr, reason: String },
    /// The peer refused the request before processing it (a drain's
    /// GOAWAY, REFUSED_STREAM), or its connection closed before the
    /// request was written: nothing reached the app.
    #[error("upstream {addr} refused the request unprocessed: {reason}")]
    Unprocessed { addr: SocketAddr, reason: String },
    #[error("app unreachable at {addr}: {reason}")]
    App { addr: SocketAddr, reason: String },
    #[error("CONNECT is not proxied")]
    ConnectUnsupported,
    #[error("response timeout after {0:?}")]
    ResponseTimeout(std::time::Duration),
    #[error("no route of {0} matches the request")]
    NoRoute(String),
    #[error("route {route}: {reason}")]
    Route { route: String, reason: String },
    /// A route's failure injection.
    #[error("{message}")]
    Injected {
        status: StatusCode,
        grpc_code: u32,
        message: String,
    },
    #[error("unauthorized: {client} may not call {server}/{route}")]
    Unauthorized {
        client: String,
        server: String,
        route: String,
    },
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::NoAuthority
            | ProxyError::InvalidAuthority { .. }
            | ProxyError::RequestBody(_) => StatusCode::BAD_REQUEST,
            ProxyError::UnknownService(_)
            | ProxyError::ControlPlaneUnreachable
            | ProxyError::DiscoveryMessageTooLarge { .. }
            | ProxyError::DiscoveryLimit { .. }
            | ProxyError::FailFast
            | ProxyError::QueueFull { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::Connect { .. }
            | ProxyError::Upstream { .. }
            | ProxyError::Unprocessed { .. }
            | ProxyError::App { .. } => StatusCode::BAD_GATEWAY,
            ProxyError::ConnectUnsupported => StatusCode::METHOD_NOT_ALLOWED,
            ProxyError::ResponseTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::NoRoute(_) => StatusCode::NOT_FOUND,
            ProxyError::Route { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            ProxyError::Injected { status, .. } => *status,
            ProxyError::Unauthorized { .. } => StatusCode::FORBIDDEN,
        }
    }

    /// The gRPC status code for the same condition.
    pub fn grpc_code(&self) -> u32 {
        match self {
            ProxyError::NoAuthority
            | ProxyError::InvalidAuthority { .. }
            | ProxyError::RequestBody(_) => 3, // INVALID_ARGUMENT
            ProxyError::ConnectUnsupported => 12, // UNIMPLEMENTED
            ProxyError::ResponseTimeout(_) => 4,  // DEADLINE_EXCEEDED
            ProxyError::NoRoute(_) => 12,         // UNIMPLEMENTED, as gRPC reads a 404
            ProxyError::Route { .. } => 13,       // INTERNAL
            ProxyError::Injected { grpc_code, .. } => *grpc_code,
            ProxyError::Unauthorized { .. } => 7, // PERMISSION_DENIED
            _ => 14,                              // UNAVAILABLE
        }
    }
}
