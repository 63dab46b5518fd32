//! One ext_proc stream (one downstream HTTP request): Envoy's messages in, the answers out, the
//! same rules as the pure-Python server (picker/protocol/extproc.py, README "Protocol"). No I/O
//! here: the server (server.rs) feeds messages and sends what comes out; `Out::Route` hands the
//! request to Python, whose answer comes back through `on_answer`.
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;

use crate::pb::{self, Request, Response};
use crate::usage::UsageTracker;

pub const FULL_DUPLEX: i32 = 4; // ProcessingMode.BodySendMode FULL_DUPLEX_STREAMED
pub const BODY_CHUNK_BYTES: usize = 62_000; // the reference EPP's per-message limit for streamed bodies

/// The replica's shared budgets (picker/protocol/limits.py): streams handled at once, and body
/// bytes buffered beyond each stream's first `small_body_bytes`.
pub struct Budget {
    pub max_streams: usize,
    pub max_buffered: usize,
    pub small_body_bytes: usize,
    pub streams: AtomicUsize,
    pub buffered: AtomicUsize,
}

impl Budget {
    pub fn new(max_streams: usize, max_buffered: usize, small_body_bytes: usize) -> Self {
        Budget { max_streams, max_buffered, small_body_bytes, streams: AtomicUsize::new(0),
                 buffered: AtomicUsize::new(0) }
    }

    pub fn open_stream(&self) -> bool {
        self.streams
            .fetch_update(Ordering::AcqRel, Ordering::Acquire,
                          |n| if n >= self.max_streams { None } else { Some(n + 1) })
            .is_ok()
    }

    pub fn close_stream(&self) {
        self.streams.fetch_sub(1, Ordering::AcqRel);
    }

    fn reserve(&self, n: usize) -> bool {
        self.buffered
            .fetch_update(Ordering::AcqRel, Ordering::Acquire,
                          |b| if b + n > self.max_buffered { None } else { Some(b + n) })
            .is_ok()
    }

    fn release(&self, n: usize) {
        if n > 0 {
            self.buffered.fetch_sub(n, Ordering::AcqRel);
        }
    }
}

/// Refusals the transport decides alone; their answers (status, OpenAI-style body, reason) are
/// Python's, built once at start (protocol/native.py), so every text stays in one place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    TooManyStreams,
    BodyBufferFull,
    BodyTooLarge,
    ProtocolError,
}

impl Refusal {
    pub const ALL: [Refusal; 4] = [Refusal::TooManyStreams, Refusal::BodyBufferFull,
                                    Refusal::BodyTooLarge, Refusal::ProtocolError];
    pub fn code(self) -> &'static str {
        match self {
            Refusal::TooManyStreams => "too_many_streams",
            Refusal::BodyBufferFull => "body_buffer_full",
            Refusal::BodyTooLarge => "body_too_large",
            Refusal::ProtocolError => "protocol_error",
        }
    }
}

/// What Python decided for a request.
pub enum Answer {
    /// Route it: the header mutation and dynamic metadata as Python wrote them, and the body to
    /// send on (FULL_DUPLEX echoes it; BUFFERED sends it only when Python changed it).
    Route { common: pb::CommonResponse, metadata: Option<pb::Struct>, body: Option<Bytes> },
    /// An immediate response (an error with its reason); the stream ends after it.
    Immediate(pb::ImmediateResponse),
}

/// What the server does next, in order.
pub enum Out {
    Send(pb::ProcessingResponse),
    /// Hand the request to Python (headers, body, subset: `take_request`) and wait for its Answer.
    Route { bodiless: bool },
    /// Send the refusal's prebuilt immediate response, tell Python (logs, metrics), end.
    Refuse(Refusal),
    /// The request ended (its response is complete): Python stops counting it in flight.
    Done,
}

/// The request as handed to Python.
pub struct RouteRequest {
    pub headers: Option<pb::HeaderMap>,
    pub chunks: Vec<Bytes>,
    pub body_len: usize,
    pub subset: Option<Vec<String>>,
}

pub struct StreamState {
    pub body_mode: i32,
    pub response_body_mode: i32,
    max_body_bytes: usize,
    headers: Option<pb::HeaderMap>,
    seen_headers: bool,
    subset: Option<Vec<String>>,
    chunks: Vec<Bytes>,
    body_bytes: usize,
    reserved: usize,
    bodiless: bool,
    after_route: Vec<pb::ProcessingResponse>, // answers that follow the routing answer (trailers)
    pub routed: bool,   // the request phase is answered (or handed to Python)
    pub finished: bool, // an immediate response ends the stream
    pub done: bool,     // the response ended (Out::Done was given)
    usage: Option<UsageTracker>,
}

impl StreamState {
    pub fn new(default_body_mode: i32, max_body_bytes: usize) -> Self {
        StreamState { body_mode: default_body_mode, response_body_mode: 0, max_body_bytes,
                      headers: None, seen_headers: false, subset: None, chunks: Vec::new(),
                      body_bytes: 0, reserved: 0, bodiless: false, after_route: Vec::new(),
                      routed: false, finished: false, done: false, usage: None }
    }

    pub fn on_message(&mut self, req: pb::ProcessingRequest, budget: &Budget) -> Vec<Out> {
        if let Some(cfg) = &req.protocol_config {
            if cfg.request_body_mode != 0 {
                self.body_mode = cfg.request_body_mode;
            }
            self.response_body_mode = cfg.response_body_mode;
        }
        if self.subset.is_none() {
            if let Some(md) = &req.metadata_context {
                self.subset = subset_hint(md);
            }
        }
        match req.request {
            Some(Request::RequestHeaders(h)) => self.request_headers(h),
            Some(Request::RequestBody(b)) => self.request_body(b, budget),
            Some(Request::RequestTrailers(_)) => {
                let trailers = response(Response::RequestTrailers(pb::TrailersResponse::default()));
                if self.routed {
                    return if self.finished { vec![] } else { vec![Out::Send(trailers)] };
                }
                self.after_route.push(trailers);
                self.route(false)
            }
            Some(Request::ResponseHeaders(h)) => {
                let ct = h.headers.as_ref().and_then(|m| header(m, "content-type")).unwrap_or_default();
                self.usage = Some(UsageTracker::new(&ct));
                let mut out = vec![];
                if h.end_of_stream {
                    out.push(self.finish());
                }
                out.push(Out::Send(response(Response::ResponseHeaders(pb::HeadersResponse {
                    response: Some(pb::CommonResponse::default()) }))));
                out
            }
            Some(Request::ResponseBody(b)) => {
                if let Some(u) = self.usage.as_mut() {
                    u.feed(&b.body);
                }
                let eos = b.end_of_stream || b.end_of_stream_without_message;
                let mut out = vec![];
                if eos {
                    out.push(self.finish());
                }
                let answer = if self.response_body_mode == FULL_DUPLEX {
                    streamed(b.body, eos)
                } else {
                    pb::CommonResponse::default()
                };
                out.push(Out::Send(response(Response::ResponseBody(pb::BodyResponse {
                    response: Some(answer) }))));
                out
            }
            Some(Request::ResponseTrailers(_)) => vec![
                self.finish(),
                Out::Send(response(Response::ResponseTrailers(pb::TrailersResponse::default()))),
            ],
            None => vec![],
        }
    }

    fn request_headers(&mut self, h: pb::HttpHeaders) -> Vec<Out> {
        if self.seen_headers {
            // one HTTP request per stream: never route (count) twice
            return self.refuse(Refusal::ProtocolError);
        }
        self.seen_headers = true;
        self.headers = Some(h.headers.unwrap_or_default());
        if h.end_of_stream {
            return self.route(true); // bodiless: the only chance to route
        }
        if self.body_mode == FULL_DUPLEX {
            return vec![]; // held until the body is complete
        }
        vec![Out::Send(strip_headers_response())]
    }

    fn request_body(&mut self, b: pb::HttpBody, budget: &Budget) -> Vec<Out> {
        if self.routed {
            return vec![];
        }
        let len = b.body.len();
        let need = (self.body_bytes + len).saturating_sub(budget.small_body_bytes + self.reserved);
        if need > 0 {
            if !budget.reserve(need) {
                return self.refuse_with(Refusal::BodyBufferFull, budget);
            }
            self.reserved += need;
        }
        if len > 0 {
            self.chunks.push(b.body);
        }
        self.body_bytes += len;
        if self.body_bytes > self.max_body_bytes {
            return self.refuse_with(Refusal::BodyTooLarge, budget);
        }
        if b.end_of_stream || b.end_of_stream_without_message {
            return self.route(false);
        }
        if self.body_mode == FULL_DUPLEX {
            return vec![];
        }
        vec![Out::Send(response(Response::RequestBody(pb::BodyResponse {
            response: Some(pb::CommonResponse::default()) })))]
    }

    fn route(&mut self, bodiless: bool) -> Vec<Out> {
        self.routed = true;
        self.bodiless = bodiless;
        vec![Out::Route { bodiless }]
    }

    /// What Python gets for Out::Route (the body's chunks leave the stream; their bytes still
    /// count against the budget until the answer, as in the Python server).
    pub fn take_request(&mut self) -> RouteRequest {
        RouteRequest { headers: self.headers.clone(), chunks: std::mem::take(&mut self.chunks),
                       body_len: self.body_bytes, subset: self.subset.clone() }
    }

    pub fn path(&self) -> String {
        self.headers.as_ref().and_then(|m| header(m, ":path")).unwrap_or_default()
    }

    fn refuse(&mut self, r: Refusal) -> Vec<Out> {
        self.routed = true;
        self.finished = true;
        vec![Out::Refuse(r)]
    }

    fn refuse_with(&mut self, r: Refusal, budget: &Budget) -> Vec<Out> {
        self.drop_body(budget);
        self.refuse(r)
    }

    pub fn drop_body(&mut self, budget: &Budget) {
        self.chunks.clear();
        budget.release(self.reserved);
        self.body_bytes = 0;
        self.reserved = 0;
    }

    /// Python's answer to Out::Route, as messages for Envoy.
    pub fn on_answer(&mut self, answer: Answer, budget: &Budget) -> Vec<pb::ProcessingResponse> {
        self.drop_body(budget);
        match answer {
            Answer::Immediate(imm) => {
                self.finished = true;
                self.after_route.clear();
                vec![response(Response::ImmediateResponse(imm))]
            }
            Answer::Route { common, metadata, body } => {
                let mut out = if self.bodiless {
                    vec![with_metadata(Response::RequestHeaders(pb::HeadersResponse {
                        response: Some(common) }), metadata)]
                } else if self.body_mode == FULL_DUPLEX {
                    let mut v = vec![with_metadata(Response::RequestHeaders(pb::HeadersResponse {
                        response: Some(common) }), metadata)];
                    v.extend(streamed_body(body.unwrap_or_default()));
                    v
                } else {
                    let mut common = common;
                    if let Some(b) = body {
                        common.body_mutation = Some(pb::BodyMutation { mutation: Some(pb::Mutation::Body(b)) });
                    }
                    vec![with_metadata(Response::RequestBody(pb::BodyResponse { response: Some(common) }),
                                       metadata)]
                };
                out.append(&mut self.after_route);
                out
            }
        }
    }

    /// The response ended (or the stream closed): Out::Done once; the usage found, if any.
    fn finish(&mut self) -> Out {
        self.done = true;
        Out::Done
    }

    pub fn take_usage(&mut self) -> Option<Vec<u8>> {
        self.usage.as_mut().and_then(|u| u.finish())
    }
}

fn response(r: Response) -> pb::ProcessingResponse {
    pb::ProcessingResponse { response: Some(r), dynamic_metadata: None }
}

fn with_metadata(r: Response, md: Option<pb::Struct>) -> pb::ProcessingResponse {
    pb::ProcessingResponse { response: Some(r), dynamic_metadata: md }
}

fn streamed(body: Bytes, end_of_stream: bool) -> pb::CommonResponse {
    pb::CommonResponse {
        body_mutation: Some(pb::BodyMutation { mutation: Some(pb::Mutation::StreamedResponse(
            pb::StreamedBodyResponse { body, end_of_stream })) }),
        ..Default::default()
    }
}

/// FULL_DUPLEX_STREAMED: the body in order, in chunks of at most BODY_CHUNK_BYTES (slices of
/// the one buffer, not copies); an empty body is one empty chunk that ends the stream.
pub fn streamed_body(body: Bytes) -> Vec<pb::ProcessingResponse> {
    let n = body.len().div_ceil(BODY_CHUNK_BYTES).max(1);
    (0..n)
        .map(|i| {
            let end = ((i + 1) * BODY_CHUNK_BYTES).min(body.len());
            let chunk = body.slice((i * BODY_CHUNK_BYTES).min(end)..end);
            response(Response::RequestBody(pb::BodyResponse { response: Some(streamed(chunk, i == n - 1)) }))
        })
        .collect()
}

/// The BUFFERED headers answer: no client may choose its own backend, so every control header
/// it sent is removed (the body answer sets the picker's).
pub fn strip_headers_response() -> pb::ProcessingResponse {
    response(Response::RequestHeaders(pb::HeadersResponse {
        response: Some(pb::CommonResponse {
            header_mutation: Some(pb::HeaderMutation {
                set_headers: vec![],
                remove_headers: crate::CONTROL_HEADERS.iter().map(|s| s.to_string()).collect(),
            }),
            ..Default::default()
        }),
    }))
}

/// A header's value (lower-case name): raw_value as UTF-8 (invalid bytes replaced), else value.
pub fn header(m: &pb::HeaderMap, name: &str) -> Option<String> {
    m.headers.iter().rev().find(|h| h.key.eq_ignore_ascii_case(name)).map(header_value)
}

pub fn header_value(h: &pb::HeaderValue) -> String {
    if h.raw_value.is_empty() {
        h.value.clone()
    } else {
        String::from_utf8_lossy(&h.raw_value).into_owned()
    }
}

/// The subset hint in `envoy.lb.subset_hint` (a list, or a comma-separated string).
pub fn subset_hint(md: &pb::Metadata) -> Option<Vec<String>> {
    let ns = md.filter_metadata.get(crate::SUBSET_NAMESPACE)?;
    let value = ns.fields.get(crate::SUBSET_HEADER)?;
    let items: Vec<String> = match &value.kind {
        Some(pb::Kind::ListValue(l)) => l.values.iter()
            .map(|v| match &v.kind { Some(pb::Kind::StringValue(s)) => s.clone(), _ => String::new() })
            .collect(),
        Some(pb::Kind::StringValue(s)) => s.split(',').map(str::to_string).collect(),
        _ => vec![],
    };
    Some(items.iter().map(|s| s.trim()).filter(|s| !s.is_empty()).map(str::to_string).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::{HeaderMap, HeaderValue, HttpBody, HttpHeaders, ProcessingRequest, ProtocolConfiguration};

    const BUFFERED: i32 = 2;

    fn headers(eos: bool, mode: Option<i32>) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(Request::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap { headers: vec![HeaderValue { key: ":path".into(), value: String::new(),
                                                                      raw_value: Bytes::from_static(b"/v1/completions") }] }),
                end_of_stream: eos,
            })),
            metadata_context: None,
            protocol_config: mode.map(|m| ProtocolConfiguration { request_body_mode: m, response_body_mode: 0 }),
        }
    }

    fn body(data: &[u8], eos: bool) -> ProcessingRequest {
        ProcessingRequest { request: Some(Request::RequestBody(HttpBody { body: Bytes::copy_from_slice(data),
                                                                           end_of_stream: eos,
                                                                           end_of_stream_without_message: false })),
                            metadata_context: None, protocol_config: None }
    }

    fn budget() -> Budget {
        Budget::new(10, 1000, 100)
    }

    fn route(body: Option<&'static [u8]>) -> Answer {
        Answer::Route { common: pb::CommonResponse { clear_route_cache: true, ..Default::default() },
                        metadata: Some(pb::Struct::default()), body: body.map(Bytes::from_static) }
    }

    #[test]
    fn buffered_answers_headers_at_once_and_routes_on_the_body() {
        let b = budget();
        let mut s = StreamState::new(FULL_DUPLEX, 1 << 20);
        let out = s.on_message(headers(false, Some(BUFFERED)), &b);
        assert!(matches!(&out[..], [Out::Send(r)] if r == &strip_headers_response()));
        let out = s.on_message(body(b"{}", true), &b);
        assert!(matches!(&out[..], [Out::Route { bodiless: false }]));
        let req = s.take_request();
        assert_eq!(req.body_len, 2);
        assert_eq!(s.path(), "/v1/completions");
        let out = s.on_answer(route(None), &b);
        assert!(matches!(&out[0].response, Some(Response::RequestBody(_))));
        assert!(out[0].dynamic_metadata.is_some());
    }

    #[test]
    fn full_duplex_holds_headers_and_echoes_the_body_in_chunks() {
        let b = Budget::new(10, 1 << 20, 100);
        let mut s = StreamState::new(FULL_DUPLEX, 1 << 20);
        assert!(s.on_message(headers(false, None), &b).is_empty());
        assert!(s.on_message(body(&[b'x'; 70_000], false), &b).is_empty());
        assert_eq!(b.buffered.load(Ordering::Acquire), 70_000 - 100);
        assert!(matches!(&s.on_message(body(&[b'y'; 60_000], true), &b)[..], [Out::Route { .. }]));
        let req = s.take_request();
        assert_eq!((req.chunks.len(), req.body_len), (2, 130_000));
        let echoed = Bytes::from(vec![b'z'; 130_000]);
        let out = s.on_answer(Answer::Route { common: Default::default(), metadata: None, body: Some(echoed) }, &b);
        assert_eq!(out.len(), 4); // headers + 3 chunks
        let sizes: Vec<(usize, bool)> = out[1..].iter().map(|r| match &r.response {
            Some(Response::RequestBody(pb::BodyResponse { response: Some(c) })) => match &c.body_mutation {
                Some(pb::BodyMutation { mutation: Some(pb::Mutation::StreamedResponse(s)) }) => (s.body.len(), s.end_of_stream),
                _ => panic!("not streamed"),
            },
            _ => panic!("not a body answer"),
        }).collect();
        assert_eq!(sizes, vec![(62_000, false), (62_000, false), (6_000, true)]);
        assert_eq!(b.buffered.load(Ordering::Acquire), 0); // released with the answer
    }

    #[test]
    fn over_the_body_limit_or_the_shared_buffer_is_refused_and_releases_its_bytes() {
        let b = Budget::new(10, 1 << 20, 100);
        let mut s = StreamState::new(FULL_DUPLEX, 1000);
        s.on_message(headers(false, None), &b);
        assert!(matches!(&s.on_message(body(&[b'x'; 1001], false), &b)[..], [Out::Refuse(Refusal::BodyTooLarge)]));
        assert!(s.finished && b.buffered.load(Ordering::Acquire) == 0);
        let small = Budget::new(10, 500, 100);
        let mut s = StreamState::new(FULL_DUPLEX, 1 << 20);
        s.on_message(headers(false, None), &small);
        assert!(s.on_message(body(&[b'x'; 550], false), &small).is_empty());
        assert!(matches!(&s.on_message(body(&[b'x'; 100], false), &small)[..], [Out::Refuse(Refusal::BodyBufferFull)]));
        assert_eq!(small.buffered.load(Ordering::Acquire), 0);
    }

    #[test]
    fn second_headers_message_is_a_protocol_error_and_bodiless_routes_on_headers() {
        let b = budget();
        let mut s = StreamState::new(BUFFERED, 1000);
        assert!(matches!(&s.on_message(headers(true, None), &b)[..], [Out::Route { bodiless: true }]));
        s.on_answer(route(None), &b);
        assert!(matches!(&s.on_message(headers(true, None), &b)[..], [Out::Refuse(Refusal::ProtocolError)]));
    }

    #[test]
    fn trailers_route_first_and_follow_the_routing_answer() {
        let b = budget();
        let mut s = StreamState::new(FULL_DUPLEX, 1000);
        s.on_message(headers(false, None), &b);
        s.on_message(body(b"{}", false), &b);
        let trailers = ProcessingRequest { request: Some(Request::RequestTrailers(Default::default())),
                                           metadata_context: None, protocol_config: None };
        assert!(matches!(&s.on_message(trailers, &b)[..], [Out::Route { bodiless: false }]));
        let out = s.on_answer(route(Some(b"{}")), &b);
        assert!(matches!(out.last().unwrap().response, Some(Response::RequestTrailers(_))));
    }

    #[test]
    fn subset_hint_as_list_or_comma_string() {
        let list = pb::Value { kind: Some(pb::Kind::ListValue(pb::ListValue { values: vec![
            pb::Value { kind: Some(pb::Kind::StringValue(" 10.0.0.2:8000 ".into())) },
            pb::Value { kind: Some(pb::Kind::NumberValue(1.0)) }] })) };
        let text = pb::Value { kind: Some(pb::Kind::StringValue("a:1, ,b:2".into())) };
        for (value, want) in [(list, vec!["10.0.0.2:8000"]), (text, vec!["a:1", "b:2"])] {
            let mut md = pb::Metadata::default();
            let mut ns = pb::Struct::default();
            ns.fields.insert(crate::SUBSET_HEADER.into(), value);
            md.filter_metadata.insert(crate::SUBSET_NAMESPACE.into(), ns);
            assert_eq!(subset_hint(&md), Some(want.iter().map(|s| s.to_string()).collect()));
        }
        assert_eq!(subset_hint(&pb::Metadata::default()), None);
    }
}
