//! Kubernetes manifests: `tether install` (the control plane, its RBAC,
//! identity Secret and the gateway) and `tether inject` (a workload's
//! native-sidecar proxy and the `tether init` container). Objects are
//! built as k8s-openapi types and written as YAML; `inject` edits the
//! workload as a YAML tree, so fields it does not know are left untouched.

use std::collections::BTreeMap;
use std::path::Path;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EnvVar,
    EnvVarSource, HTTPGetAction, Namespace, ObjectFieldSelector, PodAffinityTerm, PodAntiAffinity,
    PodSpec, PodTemplateSpec, Probe, ProjectedVolumeSource, Secret, SecretVolumeSource,
    SecurityContext, Service, ServiceAccount, ServiceAccountTokenProjection, ServicePort,
    ServiceSpec, Volume, VolumeMount, VolumeProjection,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

pub const PROXY_UID: i64 = 1337;
pub const ADMIN_PORT: i32 = 4191;
pub const TRUST_ROOT_CONFIGMAP: &str = "tether-trust-root";
pub const TOKEN_AUDIENCE: &str = "tether.io";

pub struct InstallOptions {
    pub namespace: String,
    pub image: String,
    pub ha: bool,
    pub identity_dir: std::path::PathBuf,
    pub cluster_domain: String,
}

fn meta(name: &str, namespace: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: namespace.map(Into::into),
        labels: Some(BTreeMap::from([(
            "app.kubernetes.io/part-of".to_string(),
            "tether".to_string(),
        )])),
        ..Default::default()
    }
}

fn selector(app: &str) -> BTreeMap<String, String> {
    BTreeMap::from([("app".to_string(), app.to_string())])
}

fn http_probe(path: &str, port: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::Int(port),
            ..Default::default()
        }),
        period_seconds: Some(2),
        failure_threshold: Some(30),
        ..Default::default()
    }
}

fn env_field(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A projected ServiceAccount token for the mesh's audience.
fn token_volume() -> Volume {
    Volume {
        name: "tether-token".into(),
        projected: Some(ProjectedVolumeSource {
            sources: Some(vec![VolumeProjection {
                service_account_token: Some(ServiceAccountTokenProjection {
                    audience: Some(TOKEN_AUDIENCE.into()),
                    expiration_seconds: Some(3600),
                    path: "token".into(),
                    user: None,
                }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn trust_volume() -> Volume {
    Volume {
        name: "tether-trust-root".into(),
        config_map: Some(ConfigMapVolumeSource {
            name: TRUST_ROOT_CONFIGMAP.into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn mounts() -> Vec<VolumeMount> {
    vec![
        VolumeMount {
            name: "tether-token".into(),
            mount_path: "/var/run/secrets/tether".into(),
            read_only: Some(true),
            ..Default::default()
        },
        VolumeMount {
            name: "tether-trust-root".into(),
            mount_path: "/var/run/tether/trust".into(),
            read_only: Some(true),
            ..Default::default()
        },
    ]
}

fn control_address(o_namespace: &str, cluster_domain: &str) -> String {
    format!("tether-control.{o_namespace}.svc.{cluster_domain}:8086")
}

/// What `install` says first: routes need CRDs it does not install.
const ROUTES_NOTE: &str = "\
# Routes (HTTPRoute, GRPCRoute) come from the Gateway API CRDs, group
# gateway.networking.k8s.io/v1, which this does not install. Install them
# first (the Gateway API's standard-install.yaml, v1.1 or later, has both);
# without them tether control serves no routes and logs that once.
#
# Authorization policy (Server v1beta3, AuthorizationPolicy,
# MeshTLSAuthentication, NetworkAuthentication v1alpha1, HTTPRoute v1beta3)
# comes from Linkerd's CRDs, group policy.linkerd.io, which this does not
# install either: `linkerd install --crds | kubectl apply -f -`, the
# linkerd-crds Helm chart (2.15 or later), or on a cluster without Linkerd
# `tether install --crds | kubectl apply -f -`. Without them every port gets the
# namespace's default policy (annotation config.linkerd.io/default-inbound-policy)
# or --default-inbound-policy; see docs/policy.md.
";

/// The `policy.linkerd.io` resources `tether control` watches: kind, plural,
/// version (crates/control/src/registry/kubernetes.rs, `PolicyCrd`).
pub const POLICY_CRDS: [(&str, &str, &str); 5] = [
    ("Server", "servers", "v1beta3"),
    ("AuthorizationPolicy", "authorizationpolicies", "v1alpha1"),
    (
        "MeshTLSAuthentication",
        "meshtlsauthentications",
        "v1alpha1",
    ),
    (
        "NetworkAuthentication",
        "networkauthentications",
        "v1alpha1",
    ),
    ("HTTPRoute", "httproutes", "v1beta3"),
];

const CRDS_NOTE: &str = "\
# The policy.linkerd.io CRDs tether control watches (docs/policy.md), for a
# cluster without Linkerd's: do not apply these over Linkerd's own CRDs
# (`kubectl get crd servers.policy.linkerd.io` says whether they are there);
# Tether reads Linkerd's as they are. The schemas accept any spec: tether
# control validates each resource itself and logs the ones it refuses,
# naming the field, keeping the last good state.
";

/// `tether install --crds`: the authorization-policy CRDs, as YAML documents.
pub fn policy_crds() -> String {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
        CustomResourceDefinition, CustomResourceDefinitionNames, CustomResourceDefinitionSpec,
        CustomResourceDefinitionVersion, CustomResourceValidation, JSONSchemaProps,
    };
    let any_object = || JSONSchemaProps {
        type_: Some("object".into()),
        x_kubernetes_preserve_unknown_fields: Some(true),
        ..Default::default()
    };
    let docs: Vec<String> = POLICY_CRDS
        .iter()
        .map(|(kind, plural, version)| {
            let crd = CustomResourceDefinition {
                metadata: meta(&format!("{plural}.policy.linkerd.io"), None),
                spec: CustomResourceDefinitionSpec {
                    group: "policy.linkerd.io".into(),
                    names: CustomResourceDefinitionNames {
                        kind: (*kind).into(),
                        list_kind: Some(format!("{kind}List")),
                        plural: (*plural).into(),
                        singular: Some(kind.to_ascii_lowercase()),
                        ..Default::default()
                    },
                    scope: "Namespaced".into(),
                    versions: vec![CustomResourceDefinitionVersion {
                        name: (*version).into(),
                        served: true,
                        storage: true,
                        schema: Some(CustomResourceValidation {
                            open_api_v3_schema: Some(JSONSchemaProps {
                                type_: Some("object".into()),
                                properties: Some(BTreeMap::from([
                                    ("spec".to_string(), any_object()),
                                    ("status".to_string(), any_object()),
                                ])),
                                ..Default::default()
                            }),
                        }),
                        ..Default::default()
                    }],
                    ..Default::default()
                },
                ..Default::default()
            };
            serde_yaml::to_string(&crd).expect("k8s objects serialize")
        })
        .collect();
    format!("{CRDS_NOTE}{}", docs.join("---\n"))
}

/// Every manifest of the control plane, as YAML documents.
pub fn install(o: &InstallOptions) -> anyhow::Result<String> {
    let read = |f: &str| -> anyhow::Result<String> {
        std::fs::read_to_string(o.identity_dir.join(f)).map_err(|e| {
            anyhow::anyhow!(
                "reading {}: {e} (create it with `tether identity init --out {}`)",
                o.identity_dir.join(f).display(),
                o.identity_dir.display()
            )
        })
    };
    let ns = o.namespace.as_str();
    let mut docs: Vec<String> = Vec::new();
    let mut push = |v: &dyn erased::Yaml| docs.push(v.yaml());

    push(&Namespace {
        metadata: meta(ns, None),
        ..Default::default()
    });
    push(&ServiceAccount {
        metadata: meta("tether-control", Some(ns)),
        ..Default::default()
    });
    let rule = |groups: &[&str], resources: &[&str], verbs: &[&str]| PolicyRule {
        api_groups: Some(groups.iter().map(|s| s.to_string()).collect()),
        resources: Some(resources.iter().map(|s| s.to_string()).collect()),
        verbs: verbs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    push(&ClusterRole {
        metadata: meta("tether-control", None),
        rules: Some(vec![
            rule(
                &[""],
                &["services", "pods", "namespaces"],
                &["get", "list", "watch"],
            ),
            rule(
                &["discovery.k8s.io"],
                &["endpointslices"],
                &["get", "list", "watch"],
            ),
            rule(&["authentication.k8s.io"], &["tokenreviews"], &["create"]),
            // Routes (docs/routes.md); the CRDs themselves are the Gateway API's.
            rule(
                &["gateway.networking.k8s.io"],
                &["httproutes", "grpcroutes"],
                &["get", "list", "watch"],
            ),
            // Authorization policy (docs/policy.md); the CRDs are Linkerd's.
            rule(
                &["policy.linkerd.io"],
                &[
                    "servers",
                    "authorizationpolicies",
                    "meshtlsauthentications",
                    "networkauthentications",
                    "httproutes",
                ],
                &["get", "list", "watch"],
            ),
        ]),
        ..Default::default()
    });
    push(&ClusterRoleBinding {
        metadata: meta("tether-control", None),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: "tether-control".into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: "tether-control".into(),
            namespace: Some(ns.into()),
            ..Default::default()
        }]),
    });
    push(&Secret {
        metadata: meta("tether-identity", Some(ns)),
        string_data: Some(BTreeMap::from([
            ("ca.crt".to_string(), read("ca.crt")?),
            ("issuer.crt".to_string(), read("issuer.crt")?),
            ("issuer.key".to_string(), read("issuer.key")?),
            ("token.key".to_string(), read("token.key")?),
        ])),
        ..Default::default()
    });
    push(&ConfigMap {
        metadata: meta(TRUST_ROOT_CONFIGMAP, Some(ns)),
        data: Some(BTreeMap::from([("ca.crt".to_string(), read("ca.crt")?)])),
        ..Default::default()
    });
    let replicas = if o.ha { 3 } else { 1 };
    let anti_affinity = o.ha.then(|| Affinity {
        pod_anti_affinity: Some(PodAntiAffinity {
            required_during_scheduling_ignored_during_execution: Some(vec![PodAffinityTerm {
                label_selector: Some(LabelSelector {
                    match_labels: Some(selector("tether-control")),
                    ..Default::default()
                }),
                topology_key: "kubernetes.io/hostname".into(),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    });
    let control = Container {
        name: "control".into(),
        image: Some(o.image.clone()),
        args: Some(
            [
                "control",
                "--registry",
                "kubernetes",
                "--grpc",
                "0.0.0.0:8086",
                "--admin",
                "0.0.0.0:9990",
                "--identity",
                "/var/run/tether/identity",
                "--cluster-domain",
                &o.cluster_domain,
                "--control-identity",
                &tether_identity::control::control_identity(ns, &o.cluster_domain),
            ]
            .map(String::from)
            .to_vec(),
        ),
        ports: Some(vec![
            ContainerPort {
                name: Some("grpc".into()),
                container_port: 8086,
                ..Default::default()
            },
            ContainerPort {
                name: Some("admin".into()),
                container_port: 9990,
                ..Default::default()
            },
        ]),
        readiness_probe: Some(http_probe("/ready", 9990)),
        liveness_probe: Some(http_probe("/live", 9990)),
        volume_mounts: Some(vec![VolumeMount {
            name: "identity".into(),
            mount_path: "/var/run/tether/identity".into(),
            read_only: Some(true),
            ..Default::default()
        }]),
        ..Default::default()
    };
    push(&deployment(
        "tether-control",
        ns,
        replicas,
        PodSpec {
            service_account_name: Some("tether-control".into()),
            containers: vec![control],
            affinity: anti_affinity,
            volumes: Some(vec![Volume {
                name: "identity".into(),
                secret: Some(SecretVolumeSource {
                    secret_name: Some("tether-identity".into()),
                    ..Default::default()
                }),
                ..Default::default()
            }]),
            ..Default::default()
        },
    ));
    push(&service(
        "tether-control",
        ns,
        &[("grpc", 8086), ("admin", 9990)],
        None,
    ));
    if o.ha {
        push(&PodDisruptionBudget {
            metadata: meta("tether-control", Some(ns)),
            spec: Some(PodDisruptionBudgetSpec {
                min_available: Some(IntOrString::Int(2)),
                selector: Some(LabelSelector {
                    match_labels: Some(selector("tether-control")),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    let gateway = Container {
        name: "gateway".into(),
        image: Some(o.image.clone()),
        args: Some(
            [
                "gateway".to_string(),
                "--control".into(),
                control_address(ns, &o.cluster_domain),
                "--listen".into(),
                "0.0.0.0:4180".into(),
                "--admin".into(),
                format!("0.0.0.0:{ADMIN_PORT}"),
                "--identity".into(),
                format!(
                    "tether-gateway.{ns}.serviceaccount.identity.{}",
                    o.cluster_domain
                ),
                "--identity-token-file".into(),
                "/var/run/secrets/tether/token".into(),
                "--trust-root".into(),
                "/var/run/tether/trust/ca.crt".into(),
                "--trust-domain".into(),
                o.cluster_domain.clone(),
                "--control-identity".into(),
                tether_identity::control::control_identity(ns, &o.cluster_domain),
            ]
            .to_vec(),
        ),
        ports: Some(vec![ContainerPort {
            name: Some("gateway".into()),
            container_port: 4180,
            ..Default::default()
        }]),
        readiness_probe: Some(http_probe("/ready", ADMIN_PORT)),
        liveness_probe: Some(http_probe("/live", ADMIN_PORT)),
        volume_mounts: Some(mounts()),
        ..Default::default()
    };
    push(&ServiceAccount {
        metadata: meta("tether-gateway", Some(ns)),
        ..Default::default()
    });
    push(&deployment(
        "tether-gateway",
        ns,
        if o.ha { 2 } else { 1 },
        PodSpec {
            service_account_name: Some("tether-gateway".into()),
            containers: vec![gateway],
            volumes: Some(vec![token_volume(), trust_volume()]),
            ..Default::default()
        },
    ));
    push(&service(
        "tether-gateway",
        ns,
        &[("gateway", 4180)],
        Some("LoadBalancer"),
    ));
    Ok(format!("{ROUTES_NOTE}{}", docs.join("---\n")))
}

fn deployment(name: &str, ns: &str, replicas: i32, spec: PodSpec) -> Deployment {
    Deployment {
        metadata: meta(name, Some(ns)),
        spec: DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(selector(name)),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(selector(name)),
                    ..Default::default()
                }),
                spec: Some(spec),
            },
            ..Default::default()
        },
        ..Default::default()
    }
}

fn service(name: &str, ns: &str, ports: &[(&str, i32)], kind: Option<&str>) -> Service {
    Service {
        metadata: meta(name, Some(ns)),
        spec: Some(ServiceSpec {
            selector: Some(selector(name)),
            type_: kind.map(Into::into),
            ports: Some(
                ports
                    .iter()
                    .map(|(n, p)| ServicePort {
                        name: Some(n.to_string()),
                        port: *p,
                        target_port: Some(IntOrString::Int(*p)),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        }),
        ..Default::default()
    }
}

mod erased {
    /// Anything that renders as one YAML document.
    pub trait Yaml {
        fn yaml(&self) -> String;
    }
    impl<T: serde::Serialize + k8s_openapi::Resource> Yaml for T {
        fn yaml(&self) -> String {
            let mut v = serde_yaml::to_value(self).expect("k8s objects serialize");
            if let serde_yaml::Value::Mapping(m) = &mut v {
                m.insert("apiVersion".into(), T::API_VERSION.into());
                m.insert("kind".into(), T::KIND.into());
            }
            serde_yaml::to_string(&v).expect("YAML values serialize")
        }
    }
}

// === inject ===

pub struct InjectOptions {
    pub image: String,
    pub control_namespace: String,
    pub cluster_domain: String,
}

/// The containers a meshed pod gets: `tether-init` (iptables) and the
/// `tether-proxy` native sidecar, which must be ready before the app starts.
fn sidecars(o: &InjectOptions, app_port: i64, opaque: bool) -> Vec<Container> {
    let init = Container {
        name: "tether-init".into(),
        image: Some(o.image.clone()),
        args: Some(
            [
                "init",
                "--proxy-uid",
                &PROXY_UID.to_string(),
                "--outbound-port",
                "4140",
                "--inbound-port",
                "4143",
                "--skip-inbound-ports",
                &ADMIN_PORT.to_string(),
            ]
            .map(String::from)
            .to_vec(),
        ),
        security_context: Some(SecurityContext {
            run_as_user: Some(0),
            run_as_non_root: Some(false),
            capabilities: Some(Capabilities {
                add: Some(vec!["NET_ADMIN".into(), "NET_RAW".into()]),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let proxy = Container {
        name: "tether-proxy".into(),
        image: Some(o.image.clone()),
        restart_policy: Some("Always".into()),
        // The proxy-only binary, which the image carries beside `tether`
        // (docs/kubernetes.md): a third of the code, a smaller resident set.
        command: Some(vec!["tether-proxy".into()]),
        args: Some(
            [
                "--control".to_string(),
                control_address(&o.control_namespace, &o.cluster_domain),
                "--outbound".into(),
                "127.0.0.1:4140".into(),
                "--inbound".into(),
                "0.0.0.0:4143".into(),
                "--admin".into(),
                format!("0.0.0.0:{ADMIN_PORT}"),
                "--app".into(),
                format!("127.0.0.1:{app_port}"),
                "--identity".into(),
                format!(
                    "$(TETHER_SERVICE_ACCOUNT).$(TETHER_NAMESPACE).serviceaccount.identity.{}",
                    o.cluster_domain
                ),
                "--identity-token-file".into(),
                "/var/run/secrets/tether/token".into(),
                "--trust-root".into(),
                "/var/run/tether/trust/ca.crt".into(),
                "--control-identity".into(),
                tether_identity::control::control_identity(&o.control_namespace, &o.cluster_domain),
                // The pod, so the proxy follows the inbound policy the
                // control plane serves for it (docs/policy.md).
                "--workload".into(),
                "$(TETHER_NAMESPACE)/$(TETHER_POD_NAME)".into(),
            ]
            .into_iter()
            .chain(opaque.then(|| "--inbound-opaque".to_string()))
            .collect(),
        ),
        env: Some(vec![
            env_field("TETHER_SERVICE_ACCOUNT", "spec.serviceAccountName"),
            env_field("TETHER_NAMESPACE", "metadata.namespace"),
            env_field("TETHER_POD_NAME", "metadata.name"),
        ]),
        startup_probe: Some(http_probe("/ready", ADMIN_PORT)),
        readiness_probe: Some(http_probe("/ready", ADMIN_PORT)),
        liveness_probe: Some(http_probe("/live", ADMIN_PORT)),
        security_context: Some(SecurityContext {
            run_as_user: Some(PROXY_UID),
            run_as_group: Some(PROXY_UID),
            run_as_non_root: Some(true),
            allow_privilege_escalation: Some(false),
            ..Default::default()
        }),
        volume_mounts: Some(mounts()),
        ..Default::default()
    };
    vec![init, proxy]
}

/// Where a workload keeps its pod spec.
fn pod_spec_path(kind: &str) -> Option<&'static [&'static str]> {
    Some(match kind {
        "Pod" => &["spec"],
        "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" | "Job" => {
            &["spec", "template", "spec"]
        }
        "CronJob" => &["spec", "jobTemplate", "spec", "template", "spec"],
        _ => return None,
    })
}

fn to_value<T: serde::Serialize>(t: &T) -> serde_yaml::Value {
    serde_yaml::to_value(t).expect("k8s objects serialize")
}

/// Injects one document; anything not a workload, or already injected, is
/// returned as it was.
fn inject_document(mut doc: serde_yaml::Value, o: &InjectOptions) -> serde_yaml::Value {
    let Some(path) = doc
        .get("kind")
        .and_then(|k| k.as_str())
        .and_then(pod_spec_path)
    else {
        return doc;
    };
    // The pod's own annotations sit in the metadata beside its spec.
    let opaque_ports: Vec<i64> = {
        let mut meta = Some(&doc);
        for key in &path[..path.len() - 1] {
            meta = meta.and_then(|m| m.get(*key));
        }
        meta.and_then(|m| m.get("metadata"))
            .and_then(|m| m.get("annotations"))
            .and_then(|a| a.get(tether_control::registry::kubernetes::OPAQUE_PORTS))
            .and_then(|v| v.as_str())
            .map(|v| v.split(',').filter_map(|p| p.trim().parse().ok()).collect())
            .unwrap_or_default()
    };
    let mut spec = &mut doc;
    for key in path {
        match spec.get_mut(*key) {
            Some(next) => spec = next,
            None => return doc,
        }
    }
    let Some(spec) = spec.as_mapping_mut() else {
        return doc;
    };
    let has_proxy = |list: Option<&serde_yaml::Value>| {
        list.and_then(|l| l.as_sequence()).is_some_and(|s| {
            s.iter()
                .any(|c| c.get("name").and_then(|n| n.as_str()) == Some("tether-proxy"))
        })
    };
    if has_proxy(spec.get("initContainers")) || has_proxy(spec.get("containers")) {
        return doc; // already meshed: inject is idempotent
    }
    let app_port = spec
        .get("containers")
        .and_then(|c| c.as_sequence())
        .and_then(|c| c.first())
        .and_then(|c| c.get("ports"))
        .and_then(|p| p.as_sequence())
        .and_then(|p| p.first())
        .and_then(|p| p.get("containerPort"))
        .and_then(|p| p.as_i64())
        .unwrap_or(80);
    let opaque = opaque_ports.contains(&app_port);
    let mut init: Vec<serde_yaml::Value> =
        sidecars(o, app_port, opaque).iter().map(to_value).collect();
    if let Some(existing) = spec.get("initContainers").and_then(|v| v.as_sequence()) {
        init.extend(existing.iter().cloned());
    }
    spec.insert("initContainers".into(), serde_yaml::Value::Sequence(init));
    let mut volumes: Vec<serde_yaml::Value> = spec
        .get("volumes")
        .and_then(|v| v.as_sequence())
        .cloned()
        .unwrap_or_default();
    volumes.push(to_value(&token_volume()));
    volumes.push(to_value(&trust_volume()));
    spec.insert("volumes".into(), serde_yaml::Value::Sequence(volumes));
    doc
}

/// Injects every workload of a multi-document YAML stream.
pub fn inject(input: &str, o: &InjectOptions) -> anyhow::Result<String> {
    use serde::Deserialize;
    let mut out = Vec::new();
    for (i, de) in serde_yaml::Deserializer::from_str(input).enumerate() {
        let doc = serde_yaml::Value::deserialize(de)
            .map_err(|e| anyhow::anyhow!("document {}: {e}", i + 1))?;
        if doc.is_null() {
            continue;
        }
        out.push(serde_yaml::to_string(&inject_document(doc, o))?);
    }
    Ok(out.join("---\n"))
}

/// Reads a file, or stdin for `-`.
pub fn read_input(path: &Path) -> anyhow::Result<String> {
    if path == Path::new("-") {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)?;
        Ok(s)
    } else {
        std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    fn docs(yaml: &str) -> Vec<serde_yaml::Value> {
        serde_yaml::Deserializer::from_str(yaml)
            .map(|d| serde_yaml::Value::deserialize(d).unwrap())
            .filter(|v| !v.is_null())
            .collect()
    }

    fn of_kind<T: serde::de::DeserializeOwned>(all: &[serde_yaml::Value], kind: &str) -> Vec<T> {
        all.iter()
            .filter(|d| d["kind"].as_str() == Some(kind))
            .map(|d| {
                serde_yaml::from_value(d.clone())
                    .unwrap_or_else(|e| panic!("{kind} does not parse: {e}"))
            })
            .collect()
    }

    fn install_docs(ha: bool) -> Vec<serde_yaml::Value> {
        let dir = tempfile::tempdir().unwrap();
        tether_identity::ca::init(&tether_identity::ca::InitOptions::new(
            dir.path(),
            "cluster.local",
        ))
        .unwrap();
        let yaml = install(&InstallOptions {
            namespace: "tether-system".into(),
            image: "tether:test".into(),
            ha,
            identity_dir: dir.path().into(),
            cluster_domain: "cluster.local".into(),
        })
        .unwrap();
        docs(&yaml)
    }

    #[test]
    fn install_parses_as_kubernetes_objects_with_exact_rbac() {
        let all = install_docs(false);
        let roles: Vec<ClusterRole> = of_kind(&all, "ClusterRole");
        let mut granted: Vec<(String, String, Vec<String>)> = roles[0]
            .rules
            .iter()
            .flatten()
            .flat_map(|r| {
                let group = r.api_groups.clone().unwrap_or_default().join(",");
                r.resources
                    .clone()
                    .unwrap_or_default()
                    .into_iter()
                    .map(move |res| (group.clone(), res, r.verbs.clone()))
            })
            .collect();
        granted.sort();
        let watch = vec!["get".to_string(), "list".into(), "watch".into()];
        assert_eq!(
            granted,
            vec![
                ("".into(), "namespaces".into(), watch.clone()),
                ("".into(), "pods".into(), watch.clone()),
                ("".into(), "services".into(), watch.clone()),
                (
                    "authentication.k8s.io".into(),
                    "tokenreviews".into(),
                    vec!["create".to_string()]
                ),
                (
                    "discovery.k8s.io".into(),
                    "endpointslices".into(),
                    watch.clone()
                ),
                (
                    "gateway.networking.k8s.io".into(),
                    "grpcroutes".into(),
                    watch.clone()
                ),
                (
                    "gateway.networking.k8s.io".into(),
                    "httproutes".into(),
                    watch.clone()
                ),
                (
                    "policy.linkerd.io".into(),
                    "authorizationpolicies".into(),
                    watch.clone()
                ),
                (
                    "policy.linkerd.io".into(),
                    "httproutes".into(),
                    watch.clone()
                ),
                (
                    "policy.linkerd.io".into(),
                    "meshtlsauthentications".into(),
                    watch.clone()
                ),
                (
                    "policy.linkerd.io".into(),
                    "networkauthentications".into(),
                    watch.clone()
                ),
                ("policy.linkerd.io".into(), "servers".into(), watch),
            ],
            "RBAC must cover exactly the watched resources and TokenReview"
        );
        let deployments: Vec<Deployment> = of_kind(&all, "Deployment");
        assert_eq!(deployments.len(), 2, "control plane and gateway");
        assert_eq!(deployments[0].spec.replicas, Some(1));
        let secrets: Vec<Secret> = of_kind(&all, "Secret");
        let keys: Vec<&String> = secrets[0].string_data.as_ref().unwrap().keys().collect();
        assert_eq!(keys, ["ca.crt", "issuer.crt", "issuer.key", "token.key"]);
        let _: Vec<Service> = of_kind(&all, "Service");
        let _: Vec<ClusterRoleBinding> = of_kind(&all, "ClusterRoleBinding");
        assert!(of_kind::<PodDisruptionBudget>(&all, "PodDisruptionBudget").is_empty());
    }

    #[test]
    fn install_ha_has_replicas_budget_and_anti_affinity() {
        let all = install_docs(true);
        let control = &of_kind::<Deployment>(&all, "Deployment")[0];
        assert_eq!(control.spec.replicas, Some(3));
        let pod = control.spec.template.spec.as_ref().unwrap();
        assert!(pod.affinity.as_ref().unwrap().pod_anti_affinity.is_some());
        let pdb = &of_kind::<PodDisruptionBudget>(&all, "PodDisruptionBudget")[0];
        assert_eq!(
            pdb.spec.as_ref().unwrap().min_available,
            Some(IntOrString::Int(2))
        );
    }

    const WORKLOAD: &str = r#"
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  namespace: shop
  annotations:
    team: payments
spec:
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      serviceAccountName: web
      containers:
        - name: app
          image: web:1
          ports: [{containerPort: 8080}]
      x-unknown-field: kept
---
apiVersion: v1
kind: ConfigMap
metadata: {name: settings}
data: {a: b}
"#;

    #[test]
    fn inject_adds_a_native_sidecar_keeps_the_rest_and_is_idempotent() {
        let o = InjectOptions {
            image: "tether:test".into(),
            control_namespace: "tether-system".into(),
            cluster_domain: "cluster.local".into(),
        };
        let once = inject(WORKLOAD, &o).unwrap();
        let twice = inject(&once, &o).unwrap();
        assert_eq!(once, twice, "inject is not idempotent");
        let all = docs(&once);
        let d: Deployment = serde_yaml::from_value(all[0].clone()).unwrap();
        let pod = d.spec.template.spec.unwrap();
        let init = pod.init_containers.unwrap();
        assert_eq!(init[0].name, "tether-init");
        assert!(init[0]
            .security_context
            .as_ref()
            .unwrap()
            .capabilities
            .as_ref()
            .unwrap()
            .add
            .as_ref()
            .unwrap()
            .contains(&"NET_ADMIN".to_string()));
        let proxy = &init[1];
        assert_eq!(proxy.name, "tether-proxy");
        // The proxy-only binary, not `tether proxy`.
        assert_eq!(proxy.command, Some(vec!["tether-proxy".to_string()]));
        assert_eq!(proxy.args.as_ref().unwrap()[0], "--control");
        assert_eq!(
            proxy.restart_policy.as_deref(),
            Some("Always"),
            "a native sidecar"
        );
        let startup = proxy
            .startup_probe
            .as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap();
        assert_eq!(startup.path.as_deref(), Some("/ready"));
        assert!(proxy
            .args
            .as_ref()
            .unwrap()
            .contains(&"127.0.0.1:8080".to_string()));
        // The proxy follows its pod's inbound policy: --workload NS/POD, from
        // the downward API.
        let args = proxy.args.as_ref().unwrap();
        let workload = args.iter().position(|a| a == "--workload").unwrap();
        assert_eq!(args[workload + 1], "$(TETHER_NAMESPACE)/$(TETHER_POD_NAME)");
        let env = proxy.env.as_ref().unwrap();
        let pod_name = env.iter().find(|e| e.name == "TETHER_POD_NAME").unwrap();
        assert_eq!(
            pod_name
                .value_from
                .as_ref()
                .unwrap()
                .field_ref
                .as_ref()
                .unwrap()
                .field_path,
            "metadata.name"
        );
        assert_eq!(
            proxy.security_context.as_ref().unwrap().run_as_user,
            Some(PROXY_UID)
        );
        assert_eq!(pod.containers[0].name, "app");
        // What inject does not know is left as it was.
        assert_eq!(
            all[0]["spec"]["template"]["spec"]["x-unknown-field"].as_str(),
            Some("kept")
        );
        assert_eq!(
            all[0]["metadata"]["annotations"]["team"].as_str(),
            Some("payments")
        );
        assert_eq!(all[1], docs(WORKLOAD)[1], "a ConfigMap is not touched");
        assert!(!proxy
            .args
            .as_ref()
            .unwrap()
            .contains(&"--inbound-opaque".to_string()));
    }

    #[test]
    fn crds_name_every_policy_kind_the_control_plane_watches() {
        use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
        let all = docs(&policy_crds());
        assert_eq!(all.len(), POLICY_CRDS.len());
        for (doc, (kind, plural, version)) in all.into_iter().zip(POLICY_CRDS) {
            let crd: CustomResourceDefinition = serde_yaml::from_value(doc).unwrap();
            assert_eq!(
                crd.metadata.name.as_deref(),
                Some(format!("{plural}.policy.linkerd.io").as_str())
            );
            assert_eq!(crd.spec.group, "policy.linkerd.io");
            assert_eq!(crd.spec.names.kind, kind);
            assert_eq!(crd.spec.scope, "Namespaced");
            let v = &crd.spec.versions[0];
            assert!(v.name == version && v.served && v.storage, "{kind}");
            let schema = v
                .schema
                .as_ref()
                .unwrap()
                .open_api_v3_schema
                .as_ref()
                .unwrap();
            let spec = &schema.properties.as_ref().unwrap()["spec"];
            assert_eq!(spec.x_kubernetes_preserve_unknown_fields, Some(true));
            // What kube derives as the plural of the kind the registry
            // watches: the CRD must be served under that name.
            let resource = kube::core::ApiResource::from_gvk(&kube::core::GroupVersionKind::gvk(
                "policy.linkerd.io",
                version,
                kind,
            ));
            assert_eq!(resource.plural, plural);
        }
    }

    #[test]
    fn inject_declares_the_app_port_opaque_when_the_pod_says_so() {
        let o = InjectOptions {
            image: "tether:test".into(),
            control_namespace: "tether-system".into(),
            cluster_domain: "cluster.local".into(),
        };
        let opaque = WORKLOAD.replace(
            "metadata: {labels: {app: web}}",
            "metadata: {labels: {app: web}, annotations: {tether.io/opaque-ports: \"5432, 8080\"}}",
        );
        let all = docs(&inject(&opaque, &o).unwrap());
        let d: Deployment = serde_yaml::from_value(all[0].clone()).unwrap();
        let init = d.spec.template.spec.unwrap().init_containers.unwrap();
        assert!(init[1]
            .args
            .as_ref()
            .unwrap()
            .contains(&"--inbound-opaque".to_string()));
    }
}
