//! Any primary CNI config the installer may find: validating, chaining our entry in and taking it
//! out never panics, and every edit changes only the `plugins` array and yields a valid list.

use cni_core::conflist::{
    IstioEntry, PLUGIN_TYPE, insert_entry, list_contents, parse_list, parse_single, plugins_range,
    remove_entry, single_type,
};

fn entry() -> IstioEntry {
    IstioEntry {
        plugin_log_level: "info".into(),
        cni_agent_run_dir: "/var/run/istio-cni".into(),
        ambient_enabled: true,
        enablement_selectors: serde_json::json!([]),
        exclude_namespaces: None,
        pod_namespace: "istio-system".into(),
        native_nftables: false,
        enable_ambient_detection_retry: false,
    }
}

/// `edited` keeps every byte of `original` outside its `plugins` array.
fn outside_unchanged(original: &[u8], edited: &str) {
    let range = plugins_range(original)
        .expect("the original parsed once")
        .expect("an edited list has a plugins array");
    let tail = original.len() - range.end;
    let edited = edited.as_bytes();
    assert!(
        edited.len() >= range.start + tail,
        "edit shortened the outside"
    );
    assert_eq!(
        &edited[..range.start],
        &original[..range.start],
        "bytes before plugins"
    );
    assert_eq!(
        &edited[edited.len() - tail..],
        &original[range.end..],
        "bytes after plugins"
    );
}

pub fn run(data: &[u8]) {
    let _ = parse_single(data);
    let _ = single_type(data);
    let _ = list_contents(data);
    let summary = parse_list(data);
    let _ = plugins_range(data);

    let Ok(inserted) = insert_entry(data, &entry()) else {
        return;
    };
    // The runtime must accept what we write, and our entry is the last plugin.
    let summary_after = parse_list(inserted.as_bytes()).expect("inserted config is a valid list");
    let contents = list_contents(inserted.as_bytes()).expect("inserted config lists plugins");
    assert_eq!(contents.types.last().map(String::as_str), Some(PLUGIN_TYPE));
    assert!(contents.istio_entry.is_some());

    let is_single = matches!(single_type(data), Ok(Some(_)));
    if !is_single {
        // A list that was valid stays the same list, with our entry in it.
        if let Ok(before) = &summary {
            assert_eq!(before.name, summary_after.name);
            assert_eq!(before.load_only_inlined, summary_after.load_only_inlined);
        }
        outside_unchanged(data, &inserted);
    }

    // Taking our entry out again touches only `plugins` too. For a list it leaves no istio-cni
    // behind unless the input had more than one; a single-plugin config is wrapped as it is,
    // even one whose own type is istio-cni, as Istio's installer does (RELIABILITY.md).
    let removed = remove_entry(inserted.as_bytes())
        .expect("our own output parses")
        .expect("our entry is found");
    outside_unchanged(inserted.as_bytes(), &removed);
    if !is_single {
        let istio_before = list_contents(data)
            .map(|c| c.types.iter().filter(|t| *t == PLUGIN_TYPE).count())
            .unwrap_or(0);
        if let Ok(after) = list_contents(removed.as_bytes()) {
            let left = after.types.iter().filter(|t| *t == PLUGIN_TYPE).count();
            assert!(
                left <= istio_before.saturating_sub(1),
                "{left} istio-cni entries left"
            );
        }
    }
}
