//! The ext_proc messages the picker reads and writes, as prost structs.
//!
//! Written by hand instead of generated from Envoy's .proto tree: generation needs `protoc` and
//! the whole envoy/xds/udpa/validate import graph at build time, and the picker uses a small part
//! of two messages. Field numbers and types are Envoy's (envoy/service/ext_proc/v3/
//! external_processor.proto, envoy/config/core/v3/base.proto); fields the picker does not use
//! are left out, and prost skips them when decoding. picker/tests/test_native.py checks every
//! number here against the descriptors of the xds-protos package.
use std::collections::HashMap;

use bytes::Bytes;
pub use prost_types::{value::Kind, ListValue, Struct, Value};

// ---- Envoy -> picker ---------------------------------------------------------------------
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingRequest {
    #[prost(oneof = "Request", tags = "2, 3, 4, 5, 6, 7")]
    pub request: Option<Request>,
    #[prost(message, optional, tag = "8")]
    pub metadata_context: Option<Metadata>,
    #[prost(message, optional, tag = "11")]
    pub protocol_config: Option<ProtocolConfiguration>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Request {
    #[prost(message, tag = "2")]
    RequestHeaders(HttpHeaders),
    #[prost(message, tag = "3")]
    ResponseHeaders(HttpHeaders),
    #[prost(message, tag = "4")]
    RequestBody(HttpBody),
    #[prost(message, tag = "5")]
    ResponseBody(HttpBody),
    #[prost(message, tag = "6")]
    RequestTrailers(HttpTrailers),
    #[prost(message, tag = "7")]
    ResponseTrailers(HttpTrailers),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpHeaders {
    #[prost(message, optional, tag = "1")]
    pub headers: Option<HeaderMap>,
    #[prost(bool, tag = "3")]
    pub end_of_stream: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpBody {
    #[prost(bytes = "bytes", tag = "1")]
    pub body: Bytes,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
    #[prost(bool, tag = "3")]
    pub end_of_stream_without_message: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpTrailers {
    #[prost(message, optional, tag = "1")]
    pub trailers: Option<HeaderMap>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ProtocolConfiguration {
    #[prost(int32, tag = "1")]
    pub request_body_mode: i32,
    #[prost(int32, tag = "2")]
    pub response_body_mode: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Metadata {
    #[prost(map = "string, message", tag = "1")]
    pub filter_metadata: HashMap<String, Struct>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderMap {
    #[prost(message, repeated, tag = "1")]
    pub headers: Vec<HeaderValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
    #[prost(bytes = "bytes", tag = "3")]
    pub raw_value: Bytes,
}

// ---- picker -> Envoy ---------------------------------------------------------------------
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingResponse {
    #[prost(oneof = "Response", tags = "1, 2, 3, 4, 5, 6, 7")]
    pub response: Option<Response>,
    #[prost(message, optional, tag = "8")]
    pub dynamic_metadata: Option<Struct>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Response {
    #[prost(message, tag = "1")]
    RequestHeaders(HeadersResponse),
    #[prost(message, tag = "2")]
    ResponseHeaders(HeadersResponse),
    #[prost(message, tag = "3")]
    RequestBody(BodyResponse),
    #[prost(message, tag = "4")]
    ResponseBody(BodyResponse),
    #[prost(message, tag = "5")]
    RequestTrailers(TrailersResponse),
    #[prost(message, tag = "6")]
    ResponseTrailers(TrailersResponse),
    #[prost(message, tag = "7")]
    ImmediateResponse(ImmediateResponse),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HeadersResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct BodyResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TrailersResponse {
    #[prost(message, optional, tag = "1")]
    pub header_mutation: Option<HeaderMutation>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CommonResponse {
    #[prost(int32, tag = "1")]
    pub status: i32,
    #[prost(message, optional, tag = "2")]
    pub header_mutation: Option<HeaderMutation>,
    #[prost(message, optional, tag = "3")]
    pub body_mutation: Option<BodyMutation>,
    #[prost(bool, tag = "5")]
    pub clear_route_cache: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderMutation {
    #[prost(message, repeated, tag = "1")]
    pub set_headers: Vec<HeaderValueOption>,
    #[prost(string, repeated, tag = "2")]
    pub remove_headers: Vec<String>,
}

/// HeaderValueOption.HeaderAppendAction OVERWRITE_IF_EXISTS_OR_ADD.
pub const OVERWRITE_IF_EXISTS_OR_ADD: i32 = 2;

#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValueOption {
    #[prost(message, optional, tag = "1")]
    pub header: Option<HeaderValue>,
    #[prost(int32, tag = "3")]
    pub append_action: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct BodyMutation {
    #[prost(oneof = "Mutation", tags = "1, 2, 3")]
    pub mutation: Option<Mutation>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Mutation {
    #[prost(bytes = "bytes", tag = "1")]
    Body(Bytes),
    #[prost(bool, tag = "2")]
    ClearBody(bool),
    #[prost(message, tag = "3")]
    StreamedResponse(StreamedBodyResponse),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct StreamedBodyResponse {
    #[prost(bytes = "bytes", tag = "1")]
    pub body: Bytes,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ImmediateResponse {
    #[prost(message, optional, tag = "1")]
    pub status: Option<HttpStatus>,
    #[prost(message, optional, tag = "2")]
    pub headers: Option<HeaderMutation>,
    #[prost(bytes = "bytes", tag = "3")]
    pub body: Bytes,
    #[prost(string, tag = "5")]
    pub details: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpStatus {
    #[prost(int32, tag = "1")]
    pub code: i32,
}

/// Every field above as (message, field, number), for the test against Envoy's descriptors.
pub const FIELDS: &[(&str, &str, u32)] = &[
    ("envoy.service.ext_proc.v3.ProcessingRequest", "request_headers", 2),
    ("envoy.service.ext_proc.v3.ProcessingRequest", "response_headers", 3),
    ("envoy.service.ext_proc.v3.ProcessingRequest", "request_body", 4),
    ("envoy.service.ext_proc.v3.ProcessingRequest", "response_body", 5),
    ("envoy.service.ext_proc.v3.ProcessingRequest", "request_trailers", 6),
    ("envoy.service.ext_proc.v3.ProcessingRequest", "response_trailers", 7),
    ("envoy.service.ext_proc.v3.ProcessingRequest", "metadata_context", 8),
    ("envoy.service.ext_proc.v3.ProcessingRequest", "protocol_config", 11),
    ("envoy.service.ext_proc.v3.HttpHeaders", "headers", 1),
    ("envoy.service.ext_proc.v3.HttpHeaders", "end_of_stream", 3),
    ("envoy.service.ext_proc.v3.HttpBody", "body", 1),
    ("envoy.service.ext_proc.v3.HttpBody", "end_of_stream", 2),
    ("envoy.service.ext_proc.v3.HttpBody", "end_of_stream_without_message", 3),
    ("envoy.service.ext_proc.v3.HttpTrailers", "trailers", 1),
    ("envoy.service.ext_proc.v3.ProtocolConfiguration", "request_body_mode", 1),
    ("envoy.service.ext_proc.v3.ProtocolConfiguration", "response_body_mode", 2),
    ("envoy.config.core.v3.Metadata", "filter_metadata", 1),
    ("envoy.config.core.v3.HeaderMap", "headers", 1),
    ("envoy.config.core.v3.HeaderValue", "key", 1),
    ("envoy.config.core.v3.HeaderValue", "value", 2),
    ("envoy.config.core.v3.HeaderValue", "raw_value", 3),
    ("envoy.service.ext_proc.v3.ProcessingResponse", "request_headers", 1),
    ("envoy.service.ext_proc.v3.ProcessingResponse", "response_headers", 2),
    ("envoy.service.ext_proc.v3.ProcessingResponse", "request_body", 3),
    ("envoy.service.ext_proc.v3.ProcessingResponse", "response_body", 4),
    ("envoy.service.ext_proc.v3.ProcessingResponse", "request_trailers", 5),
    ("envoy.service.ext_proc.v3.ProcessingResponse", "response_trailers", 6),
    ("envoy.service.ext_proc.v3.ProcessingResponse", "immediate_response", 7),
    ("envoy.service.ext_proc.v3.ProcessingResponse", "dynamic_metadata", 8),
    ("envoy.service.ext_proc.v3.HeadersResponse", "response", 1),
    ("envoy.service.ext_proc.v3.BodyResponse", "response", 1),
    ("envoy.service.ext_proc.v3.TrailersResponse", "header_mutation", 1),
    ("envoy.service.ext_proc.v3.CommonResponse", "status", 1),
    ("envoy.service.ext_proc.v3.CommonResponse", "header_mutation", 2),
    ("envoy.service.ext_proc.v3.CommonResponse", "body_mutation", 3),
    ("envoy.service.ext_proc.v3.CommonResponse", "clear_route_cache", 5),
    ("envoy.service.ext_proc.v3.HeaderMutation", "set_headers", 1),
    ("envoy.service.ext_proc.v3.HeaderMutation", "remove_headers", 2),
    ("envoy.config.core.v3.HeaderValueOption", "header", 1),
    ("envoy.config.core.v3.HeaderValueOption", "append_action", 3),
    ("envoy.service.ext_proc.v3.BodyMutation", "body", 1),
    ("envoy.service.ext_proc.v3.BodyMutation", "clear_body", 2),
    ("envoy.service.ext_proc.v3.BodyMutation", "streamed_response", 3),
    ("envoy.service.ext_proc.v3.StreamedBodyResponse", "body", 1),
    ("envoy.service.ext_proc.v3.StreamedBodyResponse", "end_of_stream", 2),
    ("envoy.service.ext_proc.v3.ImmediateResponse", "status", 1),
    ("envoy.service.ext_proc.v3.ImmediateResponse", "headers", 2),
    ("envoy.service.ext_proc.v3.ImmediateResponse", "body", 3),
    ("envoy.service.ext_proc.v3.ImmediateResponse", "details", 5),
    ("envoy.type.v3.HttpStatus", "code", 1),
    ("grpc.health.v1.HealthCheckRequest", "service", 1),
    ("grpc.health.v1.HealthCheckResponse", "status", 1),
];

// grpc.health.v1 (grpc/grpc src/proto/grpc/health/v1/health.proto): Envoy's active health check
// of the ext_proc cluster asks the ext_proc port itself.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct HealthCheckRequest {
    #[prost(string, tag = "1")]
    pub service: String,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct HealthCheckResponse {
    /// UNKNOWN = 0, SERVING = 1, NOT_SERVING = 2
    #[prost(int32, tag = "1")]
    pub status: i32,
}
