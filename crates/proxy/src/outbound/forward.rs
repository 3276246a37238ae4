//! `--control-plane-unavailable=forward`: when the control plane cannot
//! route a request (never reached, or the target is not a service it knows),
//! send it to the original destination, if the request names one: an IP
//! literal in the authority, or an absolute-form URI whose host resolves.
//! Plaintext only, so it is refused together with `--tls mandatory`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::client::EndpointClient;
use crate::tls::Connector;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Unavailable {
    /// Answer 503 / UNAVAILABLE at once.
    #[default]
    Fail,
    /// Send to the original destination when one is known.
    Forward,
}

impl std::str::FromStr for Unavailable {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fail" => Ok(Self::Fail),
            "forward" => Ok(Self::Forward),
            _ => Err(format!("{s:?}: expected fail or forward")),
        }
    }
}

/// Clients for original destinations, bounded.
pub struct Forwarder {
    clients: Mutex<HashMap<SocketAddr, Arc<EndpointClient>>>,
    connector: Arc<Connector>,
}

const MAX_CLIENTS: usize = 256;

impl Forwarder {
    pub fn new(connect_timeout: Duration) -> Self {
        Self {
            clients: Mutex::default(),
            connector: Connector::plain(connect_timeout),
        }
    }

    /// The original destination named by `authority` (IP literal), or by
    /// an absolute-form URI's host (resolved through DNS).
    pub async fn destination(&self, authority: &str, absolute: bool) -> Option<SocketAddr> {
        if let Ok(addr) = authority.parse::<SocketAddr>() {
            return Some(addr);
        }
        if !absolute {
            return None;
        }
        let lookup = tokio::net::lookup_host(authority);
        tokio::time::timeout(Duration::from_secs(2), lookup)
            .await
            .ok()?
            .ok()?
            .next()
    }

    pub fn client(&self, addr: SocketAddr) -> Arc<EndpointClient> {
        let mut clients = self.clients.lock().unwrap();
        if clients.len() >= MAX_CLIENTS && !clients.contains_key(&addr) {
            clients.clear();
        }
        clients
            .entry(addr)
            .or_insert_with(|| Arc::new(EndpointClient::new(addr, None, self.connector.clone())))
            .clone()
    }
}
