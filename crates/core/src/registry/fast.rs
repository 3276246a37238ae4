//! A faster reading of the document kind that churns: `kind: Endpoints`.
//!
//! The general path builds a `serde_yaml::Value` of each document, then
//! deserializes the typed document from it (tracking the field's path for
//! errors): two passes and a tree of allocations, which was half of the
//! control plane's CPU under registry churn. This path deserializes an
//! Endpoints document straight from the parser's events, and accepts only
//! what the general path reads the same way: every scalar is resolved as
//! the general path resolves it (a plain `80` is a number, never a string;
//! `"80"` is a string, never a port), and any duplicate key, unknown field,
//! tag, null, float or nested form it does not expect makes it give up.
//! It gives up on any other kind and on any invalid document too; the
//! caller then parses the whole file the general way, so every error
//! message and every other document stays exactly as that path makes it.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use super::{default_namespace, validate, Document, EndpointSpec, EndpointsDoc, SharedStrings};

/// Every document of `text`, when each is an Endpoints document that this
/// path reads exactly as the general path would and that passes
/// validation; `None` to take the general path.
pub(super) fn endpoints_documents(text: &str) -> Option<Vec<Document>> {
    let mut docs = Vec::new();
    for de in serde_yaml::Deserializer::from_str(text) {
        let doc = Document::Endpoints(de.deserialize_any(EndpointsDocVisitor).ok()?);
        validate(&doc).ok()?;
        docs.push(doc);
    }
    Some(docs)
}

/// Why this path gave up; never shown (the general path makes the error).
fn give_up<E: de::Error>() -> E {
    E::custom("not on the fast path")
}

/// A scalar as the general path's `Value` holds it.
enum Scalar {
    Str(String),
    Unsigned(u64),
    Bool(bool),
}

impl Scalar {
    fn string<E: de::Error>(self) -> Result<String, E> {
        match self {
            Scalar::Str(s) => Ok(s),
            _ => Err(give_up()),
        }
    }

    fn unsigned<T: TryFrom<u64>, E: de::Error>(self) -> Result<T, E> {
        match self {
            Scalar::Unsigned(n) => T::try_from(n).map_err(|_| give_up()),
            _ => Err(give_up()),
        }
    }

    fn bool<E: de::Error>(self) -> Result<bool, E> {
        match self {
            Scalar::Bool(b) => Ok(b),
            _ => Err(give_up()),
        }
    }
}

/// Reads one scalar the way `Value` does (`deserialize_any`); anything
/// else (null, float, sequence, mapping, tagged value) gives up.
struct AnyScalar;

impl<'de> DeserializeSeed<'de> for AnyScalar {
    type Value = Scalar;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Scalar, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for AnyScalar {
    type Value = Scalar;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, an unsigned integer or a boolean")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Scalar, E> {
        Ok(Scalar::Str(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Scalar, E> {
        Ok(Scalar::Str(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Scalar, E> {
        Ok(Scalar::Unsigned(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Scalar, E> {
        u64::try_from(v)
            .map(Scalar::Unsigned)
            .map_err(|_| give_up())
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Scalar, E> {
        Ok(Scalar::Bool(v))
    }
}

/// The next key of a mapping, which must be a string.
fn next_key<'de, A: MapAccess<'de>>(map: &mut A) -> Result<Option<String>, A::Error> {
    map.next_key_seed(AnyScalar)?
        .map(Scalar::string)
        .transpose()
}

/// Sets a field once: a second occurrence is a duplicate key, which the
/// general path rejects.
fn set_once<T, E: de::Error>(field: &mut Option<T>, value: T) -> Result<(), E> {
    match field {
        Some(_) => Err(give_up()),
        None => {
            *field = Some(value);
            Ok(())
        }
    }
}

struct EndpointsDocVisitor;

impl<'de> Visitor<'de> for EndpointsDocVisitor {
    type Value = EndpointsDoc;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an Endpoints document")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<EndpointsDoc, A::Error> {
        let (mut kind, mut service, mut namespace, mut endpoints) = (None, None, None, None);
        while let Some(key) = next_key(&mut map)? {
            match key.as_str() {
                "kind" => {
                    let k = map.next_value_seed(AnyScalar)?.string()?;
                    if k != "Endpoints" {
                        return Err(give_up());
                    }
                    set_once(&mut kind, ())?
                }
                "service" => set_once(&mut service, map.next_value_seed(AnyScalar)?.string()?)?,
                "namespace" => set_once(&mut namespace, map.next_value_seed(AnyScalar)?.string()?)?,
                "endpoints" => set_once(&mut endpoints, map.next_value_seed(EndpointList)?)?,
                _ => return Err(give_up()),
            }
        }
        match (kind, service, endpoints) {
            (Some(()), Some(service), Some(endpoints)) => Ok(EndpointsDoc {
                service,
                namespace: namespace.unwrap_or_else(default_namespace),
                endpoints,
            }),
            _ => Err(give_up()),
        }
    }
}

struct EndpointList;

impl<'de> DeserializeSeed<'de> for EndpointList {
    type Value = Vec<EndpointSpec>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for EndpointList {
    type Value = Vec<EndpointSpec>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of endpoints")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut endpoints = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        let mut shared = SharedStrings::default();
        while let Some(ep) = seq.next_element_seed(Endpoint(&mut shared))? {
            endpoints.push(ep);
        }
        Ok(endpoints)
    }
}

/// One endpoint; its identity and zone shared with the list's others.
struct Endpoint<'a>(&'a mut SharedStrings);

impl<'de> DeserializeSeed<'de> for Endpoint<'_> {
    type Value = EndpointSpec;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Endpoint<'_> {
    type Value = EndpointSpec;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an endpoint")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<EndpointSpec, A::Error> {
        let mut address: Option<SocketAddr> = None;
        let (mut port, mut ready, mut identity, mut zone) = (None, None, None, None);
        let (mut weight, mut meshed, mut name, mut labels) = (None, None, None, None);
        while let Some(key) = next_key(&mut map)? {
            match key.as_str() {
                "address" => {
                    let text = map.next_value_seed(AnyScalar)?.string()?;
                    set_once(&mut address, text.parse().map_err(|_| give_up())?)?
                }
                "port" => set_once(&mut port, map.next_value_seed(AnyScalar)?.unsigned()?)?,
                "ready" => set_once(&mut ready, map.next_value_seed(AnyScalar)?.bool()?)?,
                "identity" => {
                    let text = map.next_value_seed(AnyScalar)?.string()?;
                    set_once(&mut identity, self.0.share(&text))?
                }
                "zone" => {
                    let text = map.next_value_seed(AnyScalar)?.string()?;
                    set_once(&mut zone, self.0.share(&text))?
                }
                "weight" => set_once(&mut weight, map.next_value_seed(AnyScalar)?.unsigned()?)?,
                "meshed" => set_once(&mut meshed, map.next_value_seed(AnyScalar)?.bool()?)?,
                "name" => {
                    let text = map.next_value_seed(AnyScalar)?.string()?;
                    set_once(&mut name, std::sync::Arc::from(text))?
                }
                "labels" => set_once(&mut labels, map.next_value_seed(LabelMap)?)?,
                _ => return Err(give_up()),
            }
        }
        let defaults = EndpointSpec::new(address.ok_or_else(give_up)?);
        Ok(EndpointSpec {
            port,
            ready: ready.unwrap_or(defaults.ready),
            identity,
            zone,
            weight: weight.unwrap_or(defaults.weight),
            meshed: meshed.unwrap_or(defaults.meshed),
            name,
            labels: labels.map_or_else(super::no_labels, std::sync::Arc::new),
            ..defaults
        })
    }
}

struct LabelMap;

impl<'de> DeserializeSeed<'de> for LabelMap {
    type Value = BTreeMap<String, String>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for LabelMap {
    type Value = BTreeMap<String, String>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("labels")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut labels = BTreeMap::new();
        while let Some(key) = next_key(&mut map)? {
            let value = map.next_value_seed(AnyScalar)?.string()?;
            if labels.insert(key, value).is_some() {
                return Err(give_up());
            }
        }
        Ok(labels)
    }
}
