//! Recording fakes of the four seams (unit tests only): each writes what it was asked into one
//! shared journal, in order, holds the state a real one would (probe entries, annotations), and
//! fails where a test tells it to.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cni_core::reconcile::Redirection;
use cni_core::redirect::ambient::InpodConfig;
use cni_core::zds::WorkloadInfo;
use dataplane::inpod::RuleState;
use dataplane::netns::Netns;
use futures::future::BoxFuture;
use tokio::sync::Notify;

use super::{Annotations, BoxError, PodRules, ProbeSet, Seams, Ztunnel};
use crate::zds::ZdsError;

/// What the fakes were asked, in order, as one line each.
#[derive(Default)]
pub struct Journal(Mutex<Vec<String>>);

impl Journal {
    fn push(&self, line: String) {
        self.0.lock().unwrap().push(line);
    }

    pub fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }

    /// The lines that start with `prefix`.
    pub fn of(&self, prefix: &str) -> Vec<String> {
        self.lines()
            .into_iter()
            .filter(|l| l.starts_with(prefix))
            .collect()
    }
}

pub struct FakeRules {
    journal: Arc<Journal>,
    pub fail_enroll: AtomicBool,
}

impl PodRules for FakeRules {
    fn backend(&self) -> &'static str {
        "fake"
    }

    fn enroll(&self, _: &Netns, _: &InpodConfig) -> Result<(), BoxError> {
        self.journal.push("rules enroll".into());
        match self.fail_enroll.load(Ordering::SeqCst) {
            true => Err("the fake rules refuse".into()),
            false => Ok(()),
        }
    }

    fn unenroll(&self, _: &Netns, _: &InpodConfig) -> Result<(), BoxError> {
        self.journal.push("rules unenroll".into());
        Ok(())
    }

    fn verify(&self, _: &Netns, _: &InpodConfig) -> Result<RuleState, BoxError> {
        Ok(RuleState::InSync)
    }

    fn leftovers(&self, _: &Netns) -> Result<bool, BoxError> {
        Ok(false)
    }
}

pub struct FakeProbes {
    journal: Arc<Journal>,
    entries: Mutex<HashMap<IpAddr, String>>,
    pub fail_upsert: AtomicBool,
}

impl FakeProbes {
    pub fn entries(&self) -> HashMap<IpAddr, String> {
        self.entries.lock().unwrap().clone()
    }
}

impl ProbeSet for FakeProbes {
    fn upsert(&self, ip: IpAddr, uid: &str) -> Result<(), BoxError> {
        self.journal.push(format!("probes upsert {ip} {uid}"));
        if self.fail_upsert.load(Ordering::SeqCst) {
            return Err("the fake probe set refuses".into());
        }
        self.entries.lock().unwrap().insert(ip, uid.to_string());
        Ok(())
    }

    fn remove(&self, ip: IpAddr, uid: &str) -> Result<(), BoxError> {
        self.journal.push(format!("probes remove {ip} {uid}"));
        let mut entries = self.entries.lock().unwrap();
        if entries.get(&ip).is_some_and(|owner| owner == uid) {
            entries.remove(&ip);
        }
        Ok(())
    }

    fn prune(&self, keep: &HashSet<IpAddr>) -> Result<(), BoxError> {
        self.entries
            .lock()
            .unwrap()
            .retain(|ip, _| keep.contains(ip));
        Ok(())
    }

    fn list(&self) -> Result<Vec<(IpAddr, String)>, BoxError> {
        Ok(self.entries().into_iter().collect())
    }

    fn repair_rules(&self) -> Result<Option<RuleState>, BoxError> {
        Ok(None)
    }

    fn missing(&self, want: &[(IpAddr, String)]) -> Result<Vec<(IpAddr, String)>, BoxError> {
        let entries = self.entries();
        Ok(want
            .iter()
            .filter(|(ip, uid)| entries.get(ip) != Some(uid))
            .cloned()
            .collect())
    }
}

pub struct FakeAnnotations {
    journal: Arc<Journal>,
    /// By `namespace/name`; a pod without the annotation has no entry.
    on_pods: Mutex<HashMap<String, Redirection>>,
    /// The states whose patch the fake API server refuses.
    pub refuse: Mutex<Vec<Redirection>>,
}

impl FakeAnnotations {
    /// The annotation as the API server holds it.
    pub fn on(&self, pod: &str) -> Redirection {
        self.on_pods
            .lock()
            .unwrap()
            .get(pod)
            .copied()
            .unwrap_or(Redirection::Absent)
    }

    /// The annotation the pod came with.
    pub fn found(&self, pod: &str, state: Redirection) {
        self.on_pods.lock().unwrap().insert(pod.to_string(), state);
    }
}

impl Annotations for FakeAnnotations {
    fn set<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        state: Redirection,
    ) -> BoxFuture<'a, Result<(), kube::Error>> {
        Box::pin(async move {
            let pod = format!("{namespace}/{name}");
            self.journal.push(format!("annotate {pod} {state:?}"));
            if self.refuse.lock().unwrap().contains(&state) {
                let status =
                    kube::core::Status::failure("the fake API server refuses", "").with_code(500);
                return Err(kube::Error::Api(status.boxed()));
            }
            let mut on_pods = self.on_pods.lock().unwrap();
            match state {
                Redirection::Absent => on_pods.remove(&pod),
                _ => on_pods.insert(pod, state),
            };
            Ok(())
        })
    }
}

/// How the fake ztunnel answers an Add.
pub enum Answer {
    Ack,
    Nack,
    /// No ack within the timeout.
    Silent,
    /// Tells `reached`, then acks once `release` is notified.
    Held {
        reached: Arc<Notify>,
        release: Arc<Notify>,
    },
}

pub struct FakeZtunnel {
    journal: Arc<Journal>,
    pub connected: AtomicBool,
    pub answer: Mutex<Answer>,
}

impl Ztunnel for FakeZtunnel {
    fn wait_connected(&self, _: Duration) -> BoxFuture<'_, Result<(), ZdsError>> {
        Box::pin(async move {
            match self.connected.load(Ordering::SeqCst) {
                true => Ok(()),
                false => Err(ZdsError::NoConnection),
            }
        })
    }

    fn pod_added<'a>(
        &'a self,
        uid: &'a str,
        _: WorkloadInfo,
        _: &'a Netns,
    ) -> BoxFuture<'a, Result<(), ZdsError>> {
        Box::pin(async move {
            self.journal.push(format!("ztunnel add {uid}"));
            let held = match &*self.answer.lock().unwrap() {
                Answer::Ack => return Ok(()),
                Answer::Nack => return Err(ZdsError::Nack("the fake ztunnel refuses".into())),
                Answer::Silent => {
                    return Err(ZdsError::AckTimeout {
                        kind: "add",
                        timeout: Duration::from_secs(5),
                    });
                }
                Answer::Held { reached, release } => (reached.clone(), release.clone()),
            };
            held.0.notify_one();
            held.1.notified().await;
            self.journal.push(format!("ztunnel ack {uid}"));
            Ok(())
        })
    }

    fn pod_deleted<'a>(&'a self, uid: &'a str) -> BoxFuture<'a, Result<(), ZdsError>> {
        self.journal.push(format!("ztunnel del {uid}"));
        Box::pin(async { Ok(()) })
    }
}

/// One of each fake, sharing a journal; they succeed until told otherwise.
pub struct Fakes {
    pub journal: Arc<Journal>,
    pub rules: Arc<FakeRules>,
    pub probes: Arc<FakeProbes>,
    pub annotations: Arc<FakeAnnotations>,
    pub ztunnel: Arc<FakeZtunnel>,
}

impl Fakes {
    pub fn new() -> Fakes {
        let journal = Arc::new(Journal::default());
        Fakes {
            rules: Arc::new(FakeRules {
                journal: journal.clone(),
                fail_enroll: AtomicBool::new(false),
            }),
            probes: Arc::new(FakeProbes {
                journal: journal.clone(),
                entries: Mutex::default(),
                fail_upsert: AtomicBool::new(false),
            }),
            annotations: Arc::new(FakeAnnotations {
                journal: journal.clone(),
                on_pods: Mutex::default(),
                refuse: Mutex::default(),
            }),
            ztunnel: Arc::new(FakeZtunnel {
                journal: journal.clone(),
                connected: AtomicBool::new(true),
                answer: Mutex::new(Answer::Ack),
            }),
            journal,
        }
    }

    pub fn seams(&self) -> Seams {
        Seams {
            rules: self.rules.clone(),
            probes: self.probes.clone(),
            annotations: self.annotations.clone(),
            ztunnel: self.ztunnel.clone(),
        }
    }
}
