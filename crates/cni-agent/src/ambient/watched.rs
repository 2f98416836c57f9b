//! A pod as the agent's watch and reads decode it. The agent reads four fields of a pod's spec
//! and status for nearly every pod, and decoding the whole of both into `k8s_openapi` types
//! (every container, env var, volume and condition, each string an allocation) was most of
//! decoding a list, dropped right after; so was `metadata.managedFields` (server-side apply
//! bookkeeping, a tree of JSON objects per field manager). Spec and status are kept as JSON text
//! and read for their few fields, whole only for a sidecar pod; `managedFields` is skipped by
//! the parser and never built.

use std::borrow::Cow;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::{self, DeserializeOwned, DeserializeSeed, Deserializer, IgnoredAny, MapAccess};
use serde::{Deserialize, de::IntoDeserializer};
use serde_json::value::RawValue;

#[derive(Clone, Debug, Deserialize)]
pub struct WirePod {
    #[serde(deserialize_with = "without_managed_fields")]
    pub metadata: ObjectMeta,
    #[serde(default)]
    spec: Option<Box<RawValue>>,
    #[serde(default)]
    status: Option<Box<RawValue>>,
}

impl kube::Resource for WirePod {
    type DynamicType = ();
    type Scope = k8s_openapi::NamespaceResourceScope;

    fn kind(dt: &()) -> Cow<'_, str> {
        <Pod as kube::Resource>::kind(dt)
    }
    fn group(dt: &()) -> Cow<'_, str> {
        <Pod as kube::Resource>::group(dt)
    }
    fn version(dt: &()) -> Cow<'_, str> {
        <Pod as kube::Resource>::version(dt)
    }
    fn plural(dt: &()) -> Cow<'_, str> {
        <Pod as kube::Resource>::plural(dt)
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// The fields of `spec` every pod is read for; serde skips the rest without building it.
#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SpecFacts {
    pub host_network: Option<bool>,
    pub service_account_name: Option<String>,
}

/// The fields of `status` every pod is read for.
#[derive(Default, Deserialize)]
pub struct StatusFacts {
    pub phase: Option<String>,
    #[serde(rename = "podIP")]
    pub pod_ip: Option<String>,
    #[serde(rename = "podIPs")]
    pub pod_ips: Option<Vec<PodIpFact>>,
}

#[derive(Deserialize)]
pub struct PodIpFact {
    pub ip: String,
}

impl WirePod {
    pub fn spec_facts(&self) -> SpecFacts {
        self.decode(self.spec.as_deref()).unwrap_or_default()
    }

    pub fn status_facts(&self) -> StatusFacts {
        self.decode(self.status.as_deref()).unwrap_or_default()
    }

    /// The whole spec and status, as `k8s_openapi` has them.
    pub fn spec_and_status(
        &self,
    ) -> (
        Option<k8s_openapi::api::core::v1::PodSpec>,
        Option<k8s_openapi::api::core::v1::PodStatus>,
    ) {
        (
            self.decode(self.spec.as_deref()),
            self.decode(self.status.as_deref()),
        )
    }

    /// `raw` decoded as `T`. The API server's JSON always is; a failure is logged and read as
    /// absent, which keeps the pod's other facts.
    fn decode<T: DeserializeOwned>(&self, raw: Option<&RawValue>) -> Option<T> {
        serde_json::from_str(raw?.get())
            .inspect_err(|e| {
                let m = &self.metadata;
                tracing::error!(
                    pod = %format!("{}/{}", m.namespace.as_deref().unwrap_or_default(), m.name.as_deref().unwrap_or_default()),
                    error = %e,
                    "cannot decode the pod's spec or status"
                );
            })
            .ok()
    }
}

/// `ObjectMeta` as serde would decode it, but with `managedFields` passed over unread.
fn without_managed_fields<'de, D: Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    ObjectMeta::deserialize(Skipping {
        inner: d,
        key: "managedFields",
    })
}

/// A deserializer whose maps lack the entry named `key`.
struct Skipping<D> {
    inner: D,
    key: &'static str,
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Skipping<D> {
    type Error = D::Error;

    fn deserialize_any<V: de::Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        self.inner.deserialize_map(SkippingVisitor {
            inner: visitor,
            key: self.key,
        })
    }

    fn deserialize_struct<V: de::Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.deserialize_any(visitor)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf option unit unit_struct newtype_struct seq tuple
        tuple_struct map enum identifier ignored_any
    }
}

struct SkippingVisitor<V> {
    inner: V,
    key: &'static str,
}

impl<'de, V: de::Visitor<'de>> de::Visitor<'de> for SkippingVisitor<V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.expecting(f)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.inner.visit_map(SkippingMap {
            inner: map,
            key: self.key,
        })
    }
}

struct SkippingMap<A> {
    inner: A,
    key: &'static str,
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for SkippingMap<A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        while let Some(key) = self.inner.next_key::<Key<'de>>()? {
            if key.as_str() == self.key {
                self.inner.next_value::<IgnoredAny>()?;
                continue;
            }
            return match key {
                Key::Borrowed(k) => seed.deserialize(k.into_deserializer()).map(Some),
                Key::Owned(k) => seed.deserialize(k.into_deserializer()).map(Some),
            };
        }
        Ok(None)
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, A::Error> {
        self.inner.next_value_seed(seed)
    }
}

/// A map key, borrowed from the input where it can be (no escapes in it).
enum Key<'de> {
    Borrowed(&'de str),
    Owned(String),
}

impl Key<'_> {
    fn as_str(&self) -> &str {
        match self {
            Key::Borrowed(k) => k,
            Key::Owned(k) => k,
        }
    }
}

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> de::Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a field name")
            }
            fn visit_borrowed_str<E: de::Error>(self, k: &'de str) -> Result<Key<'de>, E> {
                Ok(Key::Borrowed(k))
            }
            fn visit_str<E: de::Error>(self, k: &str) -> Result<Key<'de>, E> {
                Ok(Key::Owned(k.to_string()))
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn metadata_is_decoded_whole_but_for_managed_fields() {
        let meta = json!({
            "name": "p", "namespace": "ns", "uid": "u1", "resourceVersion": "42",
            "labels": {"app": "a"}, "annotations": {"k": "v"},
            "managedFields": [{"manager": "kubelet", "fieldsV1": {"f:status": {"f:phase": {}}}}],
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "r", "uid": "o1"}],
            "deletionTimestamp": "2026-12-05T08:00:00Z"
        });
        let pod: WirePod = serde_json::from_value(json!({"metadata": meta.clone()})).unwrap();
        let mut whole: ObjectMeta = serde_json::from_value(meta).unwrap();
        assert!(whole.managed_fields.take().is_some());
        assert_eq!(pod.metadata, whole);
        // From text, as the client decodes: keys are borrowed, and one with an escape is not.
        let text = r#"{"metadata": {"managedFields": [], "na\u006de": "p", "uid": "u1"}}"#;
        let pod: WirePod = serde_json::from_str(text).unwrap();
        assert_eq!(pod.metadata.name.as_deref(), Some("p"));
        assert_eq!(pod.metadata.managed_fields, None);
    }

    #[test]
    fn lists_and_watch_events_decode_as_the_client_reads_them() {
        // The client decodes text; a list's `kind` and `apiVersion` go through serde's flatten
        // and a watch event is tagged, either of which would break raw values if they were
        // buffered rather than read in place.
        let pod = r#"{"metadata": {"name": "p", "resourceVersion": "8",
                                   "managedFields": [{"manager": "m", "fieldsV1": {"f:spec": {}}}]},
                      "spec": {"hostNetwork": true, "containers": [{"name": "c"}]},
                      "status": {"phase": "Running", "podIPs": [{"ip": "10.0.0.1"}]}}"#;
        let list = format!(
            r#"{{"kind": "PodList", "apiVersion": "v1", "metadata": {{"resourceVersion": "9"}},
                "items": [{pod}]}}"#
        );
        let list: kube::core::ObjectList<WirePod> = serde_json::from_str(&list).unwrap();
        let event = format!(r#"{{"type": "MODIFIED", "object": {pod}}}"#);
        let kube::core::WatchEvent::Modified(watched) = serde_json::from_str(&event).unwrap()
        else {
            panic!("not a modification");
        };
        for pod in [&list.items[0], &watched] {
            assert_eq!(pod.metadata.resource_version.as_deref(), Some("8"));
            assert_eq!(pod.metadata.managed_fields, None);
            assert_eq!(pod.spec_facts().host_network, Some(true));
            let status = pod.status_facts();
            assert_eq!(status.phase.as_deref(), Some("Running"));
            assert_eq!(status.pod_ips.unwrap()[0].ip, "10.0.0.1");
        }
    }

    #[test]
    fn metadata_that_is_not_an_object_is_an_error() {
        let err = serde_json::from_value::<WirePod>(json!({"metadata": ["p"]})).unwrap_err();
        assert!(err.to_string().contains("ObjectMeta"), "{err}");
    }
}
