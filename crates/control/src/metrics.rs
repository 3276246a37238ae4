//! The control plane's metrics, registered once and shared by every part.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceLabels {
    /// `namespace/name`
    pub service: String,
}

#[derive(Clone)]
pub struct LatencyBuckets;

impl MetricConstructor<Histogram> for LatencyBuckets {
    fn new_metric(&self) -> Histogram {
        // 0.1 ms to ~50 s.
        Histogram::new(exponential_buckets(0.0001, 2.0, 20))
    }
}

#[derive(Clone)]
pub struct ControlMetrics {
    pub subscribers: Gauge,
    pub subscribers_per_service: Family<ServiceLabels, Gauge>,
    pub endpoints_per_service: Family<ServiceLabels, Gauge>,
    /// From the registry observing a change to an update carrying it sent.
    pub update_latency: Histogram,
    pub divergent_subscriptions: Gauge,
    pub audit_repairs: Counter,
    pub audits: Counter,
    pub updates_sent: Counter,
    pub registry_documents: Gauge,
    pub registry_services: Gauge,
    pub registry_endpoints: Gauge,
    pub registry_reload_errors: Counter,
    pub registry_events_applied: Counter,
    /// Each return of freed heap memory to the operating system (memory).
    pub memory_releases: Histogram,
    /// 1 for each linked cluster's current state (multicluster::remote).
    pub links: Family<LinkLabels, Gauge>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LinkLabels {
    pub cluster: String,
    /// `serving`, `stale_export_gateway_healthy` or `dropped`.
    pub state: String,
}

impl Default for ControlMetrics {
    fn default() -> Self {
        Self {
            subscribers: Gauge::default(),
            subscribers_per_service: Family::default(),
            endpoints_per_service: Family::default(),
            update_latency: LatencyBuckets.new_metric(),
            divergent_subscriptions: Gauge::default(),
            audit_repairs: Counter::default(),
            audits: Counter::default(),
            updates_sent: Counter::default(),
            registry_documents: Gauge::default(),
            registry_services: Gauge::default(),
            registry_endpoints: Gauge::default(),
            registry_reload_errors: Counter::default(),
            registry_events_applied: Counter::default(),
            memory_releases: LatencyBuckets.new_metric(),
            links: Family::default(),
        }
    }
}

impl ControlMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "tether_destination_subscribers",
            "Live Destination.Get streams",
            self.subscribers.clone(),
        );
        registry.register(
            "tether_destination_subscribers_per_service",
            "Live Destination.Get streams per service",
            self.subscribers_per_service.clone(),
        );
        registry.register(
            "tether_registry_endpoints_per_service",
            "Endpoints (ready or not) per service",
            self.endpoints_per_service.clone(),
        );
        registry.register(
            "tether_destination_update_latency_seconds",
            "From the registry observing a change to the update carrying it being sent",
            self.update_latency.clone(),
        );
        registry.register(
            "tether_memory_release_seconds",
            "Each return of freed heap memory to the operating system (malloc_trim), \
             asked after a large free",
            self.memory_releases.clone(),
        );
        registry.register(
            "tether_destination_divergent_subscriptions",
            "Subscriptions whose last-sent state differed from the index at the last audit",
            self.divergent_subscriptions.clone(),
        );
        registry.register(
            "tether_destination_audit_repairs",
            "Subscriptions repaired by the audit",
            self.audit_repairs.clone(),
        );
        registry.register(
            "tether_destination_audits",
            "Audits run",
            self.audits.clone(),
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
        registry.register(
            "tether_control_linked_cluster",
            "1 for a linked cluster's current state: serving, stale_export_gateway_healthy (its control plane is silent but its gateway answers: last known export kept), dropped",
            self.links.clone(),
        );
    }
}
