//! picker._extproc: the compiled ext_proc transport of the endpoint picker.
//!
//! It runs the gRPC server (HTTP/2, TLS, protobuf, the ext_proc stream's rules) on threads of
//! its own and hands Python one parsed request per HTTP request; Python decides
//! (`Router.decide()`, flow control) and writes back the answer: header mutation, dynamic
//! metadata, body, or an immediate response. See picker/README.md, "Protocol".
pub mod pb;
pub mod server;
pub mod stream;
pub mod usage;
#[cfg(feature = "python")]
mod python;

/// Client-sent copies of these are removed: a client must never choose its own backend.
pub const CONTROL_HEADERS: [&str; 3] = ["x-gateway-destination-endpoint",
                                        "x-gateway-destination-endpoint-subset",
                                        "x-gateway-destination-endpoint-served"];
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_HEADER: &str = "x-gateway-destination-endpoint-subset";
