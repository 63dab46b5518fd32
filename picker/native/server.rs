//! The gRPC server: tonic (HTTP/2, TLS) on a tokio runtime of its own threads, one task per
//! ext_proc stream driving a StreamState. Requests to route go to Python through `Bridge` (a
//! queue and an eventfd the Python event loop watches); Python's answers come back on a
//! oneshot channel per request. Nothing here decides anything.
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::codegen::{http, Body, BoxFuture, Context, Poll, Service, StdError};
use tonic::{Status, Streaming};

use crate::pb;
use crate::stream::{Answer, Budget, Out, Refusal, RouteRequest, StreamState, FULL_DUPLEX};

pub const PROCESS_PATH: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";
pub const HEALTH_CHECK_PATH: &str = "/grpc.health.v1.Health/Check";

/// Something for Python to handle, in arrival order.
pub enum Event {
    Request { id: u64, req: RouteRequest, bodiless: bool, full_duplex: bool, reply: oneshot::Sender<Answer> },
    /// The request's response ended or its stream closed (once per Request): usage JSON if found.
    Done { id: u64, usage: Option<Vec<u8>> },
    /// The transport refused a request on its own (for Python's logs and metrics).
    Refused { refusal: Refusal, path: String },
}

/// The queue to Python. The eventfd is written when the queue goes from empty to not empty;
/// Python reads the eventfd before it swaps the queue out, so no wake-up is lost.
pub struct Bridge {
    queue: Mutex<Vec<Event>>,
    efd: OwnedFd,
}

impl Bridge {
    fn new() -> std::io::Result<Self> {
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Bridge { queue: Mutex::new(Vec::new()), efd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    pub fn push(&self, ev: Event) {
        let was_empty = {
            let mut q = self.queue.lock().unwrap();
            q.push(ev);
            q.len() == 1
        };
        if was_empty {
            let one: u64 = 1;
            unsafe { libc::write(self.efd.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
        }
    }

    pub fn take(&self) -> Vec<Event> {
        let mut n: u64 = 0;
        unsafe { libc::read(self.efd.as_raw_fd(), &mut n as *mut u64 as *mut libc::c_void, 8) };
        std::mem::take(&mut *self.queue.lock().unwrap())
    }

    pub fn fd(&self) -> i32 {
        self.efd.as_raw_fd()
    }
}

pub struct Config {
    pub default_body_mode: i32,
    pub max_body_bytes: usize,
    pub max_concurrent_rpcs: usize,
    pub refusals: Vec<(Refusal, pb::ImmediateResponse)>,
    /// End each stream (OK) once its request is answered: Envoy finishes the request alone, so
    /// it no longer depends on this process staying up.
    pub end_answered: bool,
}

pub struct Shared {
    pub bridge: Bridge,
    pub budget: Budget,
    pub config: Config,
    pub rpcs: AtomicUsize,
    next_id: AtomicU64,
    closing: watch::Sender<bool>,
    closing_flag: AtomicBool,
    /// grpc.health.v1 statuses by service name, set from Python (Servers.set_ready)
    pub health: Mutex<HashMap<String, i32>>,
}

impl Shared {
    pub fn new(budget: Budget, config: Config) -> std::io::Result<Arc<Self>> {
        Ok(Arc::new(Shared { bridge: Bridge::new()?, budget, config, rpcs: AtomicUsize::new(0),
                             next_id: AtomicU64::new(1), closing: watch::channel(false).0,
                             closing_flag: AtomicBool::new(false), health: Mutex::new(HashMap::new()) }))
    }

    /// Shutting down: every answered stream ends now, cleanly, and every one answered later as
    /// soon as it is (Envoy then finishes the request alone; a cut stream would fail it).
    pub fn close_answered(&self) {
        self.closing_flag.store(true, Ordering::Release);
        self.closing.send_replace(true);
    }

    fn refusal(&self, r: Refusal) -> pb::ProcessingResponse {
        let imm = self.config.refusals.iter().find(|(k, _)| *k == r).map(|(_, v)| v.clone())
            .unwrap_or_default();
        pb::ProcessingResponse { response: Some(pb::Response::ImmediateResponse(imm)), dynamic_metadata: None }
    }
}

type Sender = mpsc::Sender<Result<pb::ProcessingResponse, Status>>;

/// One stream, from its first message to its end.
async fn run_stream(shared: Arc<Shared>, mut inbound: Streaming<pb::ProcessingRequest>, tx: Sender) {
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let budget = &shared.budget;
    let mut st = StreamState::new(shared.config.default_body_mode, shared.config.max_body_bytes);
    let mut closing = shared.closing.subscribe();
    let mut handed = false; // Python has the request: it gets Done exactly once
    'stream: loop {
        let next = if st.routed {
            if shared.config.end_answered || shared.closing_flag.load(Ordering::Acquire) {
                break;
            }
            tokio::select! {
                m = inbound.message() => m,
                _ = closing.wait_for(|c| *c) => break,
            }
        } else {
            inbound.message().await
        };
        let msg = match next {
            Ok(Some(m)) => m,
            _ => break, // half-closed, reset or broken
        };
        let mut outs = st.on_message(msg, budget);
        while !outs.is_empty() {
            let mut more = Vec::new();
            for out in outs {
                match out {
                    Out::Send(r) => {
                        if tx.send(Ok(r)).await.is_err() {
                            break 'stream;
                        }
                    }
                    Out::Refuse(r) => {
                        shared.bridge.push(Event::Refused { refusal: r, path: st.path() });
                        let _ = tx.send(Ok(shared.refusal(r))).await;
                        break 'stream;
                    }
                    Out::Done => {
                        if handed {
                            shared.bridge.push(Event::Done { id, usage: st.take_usage() });
                            handed = false;
                        }
                    }
                    Out::Route { bodiless } => {
                        let (reply, answer) = oneshot::channel();
                        let full_duplex = st.body_mode == FULL_DUPLEX;
                        shared.bridge.push(Event::Request { id, req: st.take_request(), bodiless, full_duplex, reply });
                        handed = true;
                        let answer = tokio::select! {
                            a = answer => a,
                            _ = tx.closed() => break 'stream, // Envoy reset the stream (client gone)
                        };
                        match answer {
                            Ok(a) => more.extend(st.on_answer(a, budget).into_iter().map(Out::Send)),
                            Err(_) => break 'stream, // Python dropped it (server stopping)
                        }
                    }
                }
            }
            outs = more;
        }
        if st.finished {
            break;
        }
    }
    st.drop_body(budget);
    if handed {
        shared.bridge.push(Event::Done { id, usage: st.take_usage() });
    }
}

/// Over --max-streams: the first message gets the refusal, nothing is held.
async fn refuse_stream(shared: Arc<Shared>, mut inbound: Streaming<pb::ProcessingRequest>, tx: Sender) {
    if let Ok(Some(_)) = inbound.message().await {
        shared.bridge.push(Event::Refused { refusal: Refusal::TooManyStreams, path: String::new() });
        let _ = tx.send(Ok(shared.refusal(Refusal::TooManyStreams))).await;
    }
}

/// Counts a stream against the budget and the gRPC ceiling from its start to its end.
struct StreamGuard {
    shared: Arc<Shared>,
    counted: bool,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if self.counted {
            self.shared.budget.close_stream();
        }
        self.shared.rpcs.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The ExternalProcessor service, written as tonic's code generator would write it (without
/// protoc: the messages are in pb.rs).
#[derive(Clone)]
pub struct ExtProcService {
    pub shared: Arc<Shared>,
    pub max_message_bytes: usize,
}

struct Process(Arc<Shared>);

type Answers = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::ProcessingResponse, Status>> + Send>>;

impl tonic::server::StreamingService<pb::ProcessingRequest> for Process {
    type Response = pb::ProcessingResponse;
    type ResponseStream = Answers;
    type Future = BoxFuture<tonic::Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: tonic::Request<Streaming<pb::ProcessingRequest>>) -> Self::Future {
        let shared = self.0.clone();
        Box::pin(async move {
            if shared.rpcs.fetch_add(1, Ordering::AcqRel) >= shared.config.max_concurrent_rpcs {
                shared.rpcs.fetch_sub(1, Ordering::AcqRel);
                return Err(Status::resource_exhausted("too many concurrent ext_proc streams"));
            }
            let counted = shared.budget.open_stream();
            let guard = StreamGuard { shared: shared.clone(), counted };
            let (tx, mut rx) = mpsc::channel(16);
            let inbound = request.into_inner();
            tokio::spawn(async move {
                let _guard = guard;
                if counted {
                    run_stream(shared, inbound, tx).await;
                } else {
                    refuse_stream(shared, inbound, tx).await;
                }
            });
            // The response headers go with the first answer, as grpcio sends them: a stream this
            // replica dies on before answering (being decided, or held in flow control) has then
            // had no response from it, and Envoy retries it on another replica (`reset`).
            let first = rx.recv().await;
            let answers: Answers = Box::pin(tokio_stream::iter(first).chain(ReceiverStream::new(rx)));
            Ok(tonic::Response::new(answers))
        })
    }
}

impl<B> Service<http::Request<B>> for ExtProcService
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() == HEALTH_CHECK_PATH {
            let shared = self.shared.clone();
            return Box::pin(async move {
                let codec = tonic_prost::ProstCodec::<pb::HealthCheckResponse, pb::HealthCheckRequest>::default();
                Ok(tonic::server::Grpc::new(codec).unary(HealthCheck(shared), req).await)
            });
        }
        if req.uri().path() != PROCESS_PATH {
            return Box::pin(async move { Ok(Status::unimplemented("").into_http()) });
        }
        let shared = self.shared.clone();
        let max = self.max_message_bytes;
        Box::pin(async move {
            let codec = tonic_prost::ProstCodec::<pb::ProcessingResponse, pb::ProcessingRequest>::default();
            let mut grpc = tonic::server::Grpc::new(codec).apply_max_message_size_config(Some(max), Some(max));
            Ok(grpc.streaming(Process(shared), req).await)
        })
    }
}

/// grpc.health.v1.Health/Check on the ext_proc port: what Python set, NOT_FOUND for a service it
/// never named (as grpcio's HealthServicer answers).
struct HealthCheck(Arc<Shared>);

impl tonic::server::UnaryService<pb::HealthCheckRequest> for HealthCheck {
    type Response = pb::HealthCheckResponse;
    type Future = BoxFuture<tonic::Response<Self::Response>, Status>;

    fn call(&mut self, request: tonic::Request<pb::HealthCheckRequest>) -> Self::Future {
        let status = self.0.health.lock().unwrap().get(&request.get_ref().service).copied();
        Box::pin(async move {
            match status {
                Some(status) => Ok(tonic::Response::new(pb::HealthCheckResponse { status })),
                None => Err(Status::not_found("unknown service")),
            }
        })
    }
}

impl tonic::server::NamedService for ExtProcService {
    const NAME: &'static str = "envoy.service.ext_proc.v3.ExternalProcessor";
}

pub struct ServeSettings {
    pub addr: SocketAddr,
    pub tls: Option<(Vec<u8>, Vec<u8>)>, // (certificate PEM, key PEM)
    pub max_message_bytes: usize,
    pub max_concurrent_streams: u32,
}

/// A listening socket with SO_REUSEPORT, so that several worker processes serve one port.
pub fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    if addr.is_ipv6() {
        socket.set_only_v6(false)?;
    }
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    socket.set_nonblocking(true)?;
    Ok(socket.into())
}

/// Serve until `shutdown` fires; then stop taking connections and streams and wait for the open
/// ones (the caller bounds that wait). `ready` gets the outcome of the setup (TLS, listener).
pub async fn serve(shared: Arc<Shared>, listener: std::net::TcpListener, s: ServeSettings,
                   shutdown: oneshot::Receiver<()>,
                   ready: std::sync::mpsc::Sender<Result<(), String>>) -> Result<(), String> {
    let setup = || -> Result<_, String> {
        let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| e.to_string())?;
        let mut builder = tonic::transport::Server::builder()
            .max_concurrent_streams(Some(s.max_concurrent_streams))
            // a large prompt arrives on one round trip of flow-control credit, not 64 KiB at a time
            .initial_stream_window_size(Some(4 * 1024 * 1024))
            .initial_connection_window_size(Some(16 * 1024 * 1024));
        if let Some((cert, key)) = s.tls {
            let identity = tonic::transport::Identity::from_pem(cert, key);
            builder = builder
                .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
                .map_err(|e| format!("TLS: {e}"))?;
        }
        Ok((listener, builder))
    };
    let (listener, builder) = match setup() {
        Ok(x) => {
            let _ = ready.send(Ok(()));
            x
        }
        Err(e) => {
            let _ = ready.send(Err(e.clone()));
            return Err(e);
        }
    };
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let svc = ExtProcService { shared, max_message_bytes: s.max_message_bytes };
    builder
        .serve_with_incoming_shutdown(svc, incoming, async { let _ = shutdown.await; })
        .await
        .map_err(|e| e.to_string())
}

