//! The control plane's metrics, registered once and shared by every part.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Default)]
pub struct ControlMetrics {
    pub subscribers: Gauge,
    pub updates_sent: Counter,
    pub registry_documents: Gauge,
    pub registry_services: Gauge,
    pub registry_endpoints: Gauge,
    pub registry_reload_errors: Counter,
    pub registry_events_applied: Counter,
}

impl ControlMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "tether_destination_subscribers",
            "Live Destination.Get streams",
            self.subscribers.clone(),
        );
        registry.register(
            "tether_destination_updates_sent",
            "Destination updates (Add, Remove, NoEndpoints) sent to subscribers",
            self.updates_sent.clone(),
        );
        registry.register(
            "tether_registry_documents",
            "Registry documents currently loaded",
            self.registry_documents.clone(),
        );
        registry.register(
            "tether_registry_services",
            "Services currently in the index",
            self.registry_services.clone(),
        );
        registry.register(
            "tether_registry_endpoints",
            "Endpoints (ready or not) currently in the index",
            self.registry_endpoints.clone(),
        );
        registry.register(
            "tether_registry_reload_errors",
            "Registry files rejected; the last good state of each stays in force",
            self.registry_reload_errors.clone(),
        );
        registry.register(
            "tether_registry_events_applied",
            "Registry changes (per file) applied to the index",
            self.registry_events_applied.clone(),
        );
    }
}
