//! What clients cost the API server, read from its own `/metrics` (Prometheus text): requests by
//! verb and resource, and the bytes of the watch events and responses it sent. The counters are
//! the server's, of all its clients: a bench reads them around a window in which only the client
//! it measures talks to the server, or keeps its own requests to verbs it can tell apart.

use std::collections::HashMap;

/// One scrape: every sample, keyed by its series (`name{labels}` as the server printed it).
#[derive(Clone, Debug, Default)]
pub struct Scrape {
    samples: HashMap<String, f64>,
}

impl Scrape {
    /// Parses the text exposition format; comments and lines that are not samples are skipped.
    pub fn parse(text: &str) -> Scrape {
        let samples = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (series, value) = l.rsplit_once(' ')?;
                Some((series.to_string(), value.parse().ok()?))
            })
            .collect();
        Scrape { samples }
    }

    /// `GET /metrics` with `client` (which needs the right to read it, as the admin has).
    pub async fn read(client: &kube::Client) -> Result<Scrape, kube::Error> {
        let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
        Ok(Scrape::parse(&client.request_text(req).await?))
    }

    /// The sum of metric `name`'s samples whose labels pass `keep` (label name → value).
    pub fn sum(&self, name: &str, keep: impl Fn(&HashMap<&str, &str>) -> bool) -> f64 {
        self.samples
            .iter()
            .filter_map(|(series, v)| {
                let labels = series.strip_prefix(name)?;
                let labels = match labels {
                    "" => HashMap::new(),
                    l => parse_labels(l.strip_prefix('{')?.strip_suffix('}')?),
                };
                keep(&labels).then_some(*v)
            })
            .sum()
    }

    /// [`sum`](Self::sum) now minus the same in `before`.
    pub fn growth(
        &self,
        before: &Scrape,
        name: &str,
        keep: impl Fn(&HashMap<&str, &str>) -> bool,
    ) -> f64 {
        self.sum(name, &keep) - before.sum(name, &keep)
    }
}

/// `a="x",b="y"` (values as Kubernetes prints them: no commas or escaped quotes in the labels
/// this module reads).
fn parse_labels(text: &str) -> HashMap<&str, &str> {
    text.split("\",")
        .filter_map(|kv| {
            let (k, v) = kv.split_once("=\"")?;
            Some((k.trim_start_matches(','), v.trim_end_matches('"')))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP apiserver_request_total Counter of apiserver requests
# TYPE apiserver_request_total counter
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="namespaces",scope="cluster",subresource="",verb="LIST",version="v1"} 3
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="pods",scope="cluster",subresource="",verb="WATCH",version="v1"} 2
apiserver_request_total{code="201",component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="",verb="POST",version="v1"} 40
apiserver_watch_events_sizes_sum{group="",kind="Pod",version="v1"} 1234.5
process_resident_memory_bytes 1.048576e+08
"#;

    #[test]
    fn sums_the_series_whose_labels_match() {
        let s = Scrape::parse(TEXT);
        let reads = s.sum("apiserver_request_total", |l| {
            matches!(l.get("verb"), Some(&("LIST" | "WATCH")))
        });
        assert_eq!(reads, 5.0);
        assert_eq!(
            s.sum("apiserver_request_total", |l| l.get("resource")
                == Some(&"pods")),
            42.0
        );
        assert_eq!(s.sum("apiserver_watch_events_sizes_sum", |_| true), 1234.5);
        assert_eq!(
            s.sum("process_resident_memory_bytes", |_| true),
            104857600.0
        );
    }

    #[test]
    fn a_name_is_not_the_prefix_of_a_longer_one() {
        let s = Scrape::parse(TEXT);
        assert_eq!(s.sum("apiserver_request", |_| true), 0.0);
    }

    #[test]
    fn growth_is_the_difference_of_two_scrapes() {
        let before = Scrape::parse(TEXT);
        let after = Scrape::parse(&TEXT.replace("} 3\n", "} 10\n"));
        let lists = |l: &HashMap<&str, &str>| l.get("verb") == Some(&"LIST");
        assert_eq!(after.growth(&before, "apiserver_request_total", lists), 7.0);
    }
}
