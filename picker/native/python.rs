//! The Python face of the transport: `Server` (start, events, drain, stop) and `Pending` (one
//! request's reply channel). Conversions between Python objects and the messages live here;
//! the tokio threads never touch Python objects except to drop a lent bytes object.
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use tokio::sync::oneshot;

use crate::pb;
use crate::server::{bind, serve, Config, Event, ServeSettings, Shared};
use crate::stream::{header_value, Answer, Budget, Refusal};

/// A Python bytes object lent to the encoder: its buffer is immutable and lives as long as the
/// reference held here, so the tokio threads may read it without the GIL.
struct LentBytes {
    _owner: Py<PyBytes>,
    ptr: *const u8,
    len: usize,
}

unsafe impl Send for LentBytes {}

impl AsRef<[u8]> for LentBytes {
    fn as_ref(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

fn lend(b: &Bound<'_, PyBytes>) -> Bytes {
    let data = b.as_bytes();
    if data.is_empty() {
        return Bytes::new();
    }
    Bytes::from_owner(LentBytes { _owner: b.clone().unbind(), ptr: data.as_ptr(), len: data.len() })
}

fn set_headers(headers: Vec<(String, String)>) -> Vec<pb::HeaderValueOption> {
    headers
        .into_iter()
        .map(|(key, value)| pb::HeaderValueOption {
            header: Some(pb::HeaderValue { key, value: String::new(), raw_value: Bytes::from(value.into_bytes()) }),
            append_action: pb::OVERWRITE_IF_EXISTS_OR_ADD,
        })
        .collect()
}

fn to_value(obj: &Bound<'_, PyAny>) -> PyResult<pb::Value> {
    let kind = if obj.is_none() {
        pb::Kind::NullValue(0)
    } else if let Ok(s) = obj.cast::<PyString>() {
        pb::Kind::StringValue(s.to_str()?.to_owned())
    } else if obj.is_instance_of::<PyBool>() {
        pb::Kind::BoolValue(obj.extract::<bool>()?)
    } else if obj.is_instance_of::<PyInt>() || obj.is_instance_of::<PyFloat>() {
        pb::Kind::NumberValue(obj.extract::<f64>()?)
    } else if let Ok(d) = obj.cast::<PyDict>() {
        pb::Kind::StructValue(to_struct(d)?)
    } else if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let mut values = Vec::new();
        for item in obj.try_iter()? {
            values.push(to_value(&item?)?);
        }
        pb::Kind::ListValue(pb::ListValue { values })
    } else {
        return Err(PyValueError::new_err(format!("dynamic metadata cannot hold {}", obj.get_type().name()?)));
    };
    Ok(pb::Value { kind: Some(kind) })
}

fn to_struct(d: &Bound<'_, PyDict>) -> PyResult<pb::Struct> {
    let mut s = pb::Struct::default();
    for (k, v) in d.iter() {
        s.fields.insert(k.extract::<String>()?, to_value(&v)?);
    }
    Ok(s)
}

fn immediate(status: i32, headers: Vec<(String, String)>, body: &Bound<'_, PyBytes>, details: String)
             -> pb::ImmediateResponse {
    pb::ImmediateResponse {
        status: Some(pb::HttpStatus { code: status }),
        headers: Some(pb::HeaderMutation { set_headers: set_headers(headers), remove_headers: vec![] }),
        body: Bytes::copy_from_slice(body.as_bytes()),
        details,
    }
}

/// One request handed to Python: answer it once with `route` or `immediate`.
#[pyclass(module = "picker._extproc", frozen)]
struct Pending {
    reply: Mutex<Option<oneshot::Sender<Answer>>>,
}

impl Pending {
    fn send(&self, answer: Answer) -> bool {
        match self.reply.lock().unwrap().take() {
            Some(tx) => tx.send(answer).is_ok(),
            None => false,
        }
    }
}

#[pymethods]
impl Pending {
    /// Route the request. False if its stream is gone (or it was answered already).
    #[pyo3(signature = (set_headers, remove_headers, metadata, body, clear_route_cache=true))]
    fn route(&self, set_headers: Vec<(String, String)>, remove_headers: Vec<String>,
             metadata: Option<&Bound<'_, PyDict>>, body: Option<&Bound<'_, PyBytes>>,
             clear_route_cache: bool) -> PyResult<bool> {
        let common = pb::CommonResponse {
            header_mutation: Some(pb::HeaderMutation { set_headers: self::set_headers(set_headers), remove_headers }),
            clear_route_cache,
            ..Default::default()
        };
        let metadata = metadata.map(to_struct).transpose()?;
        Ok(self.send(Answer::Route { common, metadata, body: body.map(lend) }))
    }

    /// Answer with an immediate response; the stream ends after it.
    fn immediate(&self, status: i32, headers: Vec<(String, String)>, body: &Bound<'_, PyBytes>,
                 details: String) -> bool {
        self.send(Answer::Immediate(immediate(status, headers, body, details)))
    }
}

type Served = Arc<(Mutex<Option<Result<(), String>>>, Condvar)>;

#[pyclass(module = "picker._extproc", frozen)]
struct Server {
    shared: Arc<Shared>,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    shutdown: Mutex<Option<oneshot::Sender<()>>>,
    served: Served,
    port: u16,
}

#[pymethods]
impl Server {
    #[new]
    #[pyo3(signature = (host, port, *, refusals, default_body_mode, max_body_bytes, max_message_bytes,
                        max_streams, max_buffered_bytes, small_body_bytes, max_concurrent_streams,
                        max_concurrent_rpcs, cert_pem=None, key_pem=None, threads=1,
                        end_answered=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(host: &str, port: u16, refusals: &Bound<'_, PyDict>, default_body_mode: i32,
           max_body_bytes: usize, max_message_bytes: usize, max_streams: usize,
           max_buffered_bytes: usize, small_body_bytes: usize, max_concurrent_streams: u32,
           max_concurrent_rpcs: usize, cert_pem: Option<Vec<u8>>, key_pem: Option<Vec<u8>>,
           threads: usize, end_answered: bool) -> PyResult<Self> {
        let mut answers = Vec::new();
        for r in Refusal::ALL {
            let item = refusals.get_item(r.code())?
                .ok_or_else(|| PyValueError::new_err(format!("no answer for refusal {}", r.code())))?;
            let (status, headers, body, details): (i32, Vec<(String, String)>, Bound<'_, PyBytes>, String) =
                item.extract()?;
            answers.push((r, immediate(status, headers, &body, details)));
        }
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let addr: SocketAddr = (host, port).to_socket_addrs()
            .map_err(|e| PyValueError::new_err(format!("bad listen address {host}:{port}: {e}")))?
            .next()
            .ok_or_else(|| PyValueError::new_err(format!("bad listen address {host}:{port}")))?;
        let listener = bind(addr).map_err(|e| PyOSError::new_err(format!("cannot listen on {addr}: {e}")))?;
        let port = listener.local_addr().map_err(|e| PyOSError::new_err(e.to_string()))?.port();
        let config = Config { default_body_mode, max_body_bytes, max_concurrent_rpcs, refusals: answers,
                              end_answered };
        let shared = Shared::new(Budget::new(max_streams, max_buffered_bytes, small_body_bytes), config)
            .map_err(|e| PyOSError::new_err(e.to_string()))?;
        let tls = match (cert_pem, key_pem) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => return Err(PyValueError::new_err("TLS needs both cert_pem and key_pem")),
        };
        let settings = ServeSettings { addr, tls, max_message_bytes, max_concurrent_streams };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("picker-extproc")
            .enable_all()
            .build()
            .map_err(|e| PyOSError::new_err(e.to_string()))?;
        let (stop_tx, stop_rx) = oneshot::channel();
        let served: Served = Arc::new((Mutex::new(None), Condvar::new()));
        let (task_shared, task_served) = (shared.clone(), served.clone());
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        runtime.spawn(async move {
            let r = serve(task_shared, listener, settings, stop_rx, ready_tx).await;
            let (lock, cv) = &*task_served;
            *lock.lock().unwrap() = Some(r);
            cv.notify_all();
        });
        // the TLS configuration is checked before the first connection: a bad certificate fails here
        match ready_rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(PyValueError::new_err(format!("ext_proc server: {e}"))),
            Err(_) => return Err(PyOSError::new_err("ext_proc server did not start")),
        }
        Ok(Server { shared, runtime: Mutex::new(Some(runtime)), shutdown: Mutex::new(Some(stop_tx)),
                    served, port })
    }

    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// The eventfd that becomes readable when events wait (for loop.add_reader).
    fn fileno(&self) -> i32 {
        self.shared.bridge.fd()
    }

    /// Streams handled now (counted against max_streams).
    #[getter]
    fn streams(&self) -> usize {
        self.shared.budget.streams.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Calls in progress (counted against max_concurrent_rpcs, before their first message too).
    #[getter]
    fn calls(&self) -> usize {
        self.shared.rpcs.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Body bytes buffered now beyond each stream's own first small_body_bytes.
    #[getter]
    fn buffered(&self) -> usize {
        self.shared.budget.buffered.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The waiting events, oldest first: (0, id, Pending, headers, body, subset, bodiless,
    /// full_duplex),
    /// (1, id, usage JSON or None) when a handed request ends, (2, code, path) for a refusal the
    /// transport made alone.
    fn take<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.shared.bridge.take();
        let out = PyList::empty(py);
        for ev in events {
            match ev {
                Event::Request { id, req, bodiless, full_duplex, reply } => {
                    let headers = PyDict::new(py);
                    if let Some(m) = &req.headers {
                        for h in &m.headers {
                            let key = if h.key.bytes().any(|b| b.is_ascii_uppercase()) {
                                h.key.to_lowercase()
                            } else {
                                h.key.clone()
                            };
                            headers.set_item(key, header_value(h))?;
                        }
                    }
                    let body: Py<PyAny> = if req.body_len == 0 {
                        py.None()
                    } else {
                        PyBytes::new_with(py, req.body_len, |buf| {
                            let mut at = 0;
                            for c in &req.chunks {
                                buf[at..at + c.len()].copy_from_slice(c);
                                at += c.len();
                            }
                            Ok(())
                        })?.into_any().unbind()
                    };
                    drop(req.chunks);
                    let subset: Py<PyAny> = match req.subset {
                        Some(s) => PyList::new(py, s)?.into_any().unbind(),
                        None => py.None(),
                    };
                    let pending = Py::new(py, Pending { reply: Mutex::new(Some(reply)) })?;
                    out.append((0, id, pending, headers, body, subset, bodiless, full_duplex))?;
                }
                Event::Done { id, usage } => {
                    let usage: Py<PyAny> = match usage {
                        Some(u) => PyBytes::new(py, &u).into_any().unbind(),
                        None => py.None(),
                    };
                    out.append((1, id, usage))?;
                }
                Event::Refused { refusal, path } => out.append((2, refusal.code(), path))?,
            }
        }
        Ok(out)
    }

    /// The grpc.health.v1 status (1 SERVING, 2 NOT_SERVING) of `service` on the ext_proc port.
    fn set_health(&self, service: &str, status: i32) {
        self.shared.health.lock().unwrap().insert(service.to_string(), status);
    }

    /// Shutting down: answered streams end now, cleanly; the others once answered.
    fn close_answered(&self) {
        self.shared.close_answered();
    }

    /// Stop taking connections and streams; wait up to `grace` seconds for the open streams, then
    /// cut what is left. Blocks (without the GIL): call it from a thread.
    fn shutdown(&self, py: Python<'_>, grace: f64) {
        py.detach(|| {
            if let Some(tx) = self.shutdown.lock().unwrap().take() {
                let _ = tx.send(());
            }
            let deadline = Instant::now() + Duration::from_secs_f64(grace.max(0.0));
            let (lock, cv) = &*self.served;
            let mut done = lock.lock().unwrap();
            while done.is_none() {
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                done = cv.wait_timeout(done, deadline - now).unwrap().0;
            }
            drop(done);
            if let Some(rt) = self.runtime.lock().unwrap().take() {
                rt.shutdown_timeout(Duration::from_millis(200));
            }
        });
    }
}

#[pymodule]
fn _extproc(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Server>()?;
    m.add_class::<Pending>()?;
    m.add("CONTROL_HEADERS", crate::CONTROL_HEADERS.to_vec())?;
    m.add("SUBSET_NAMESPACE", crate::SUBSET_NAMESPACE)?;
    m.add("SUBSET_HEADER", crate::SUBSET_HEADER)?;
    m.add("BODY_CHUNK_BYTES", crate::stream::BODY_CHUNK_BYTES)?;
    m.add("FULL_DUPLEX", crate::stream::FULL_DUPLEX)?;
    m.add("OVERWRITE_IF_EXISTS_OR_ADD", pb::OVERWRITE_IF_EXISTS_OR_ADD)?;
    m.add("FIELDS", pb::FIELDS.to_vec())?;
    m.add("REFUSALS", Refusal::ALL.iter().map(|r| r.code()).collect::<Vec<_>>())?;
    Ok(())
}
