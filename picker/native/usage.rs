//! Finds the `usage` object of a response: a JSON body, or the SSE chunk that carries it (the
//! same rules as picker/protocol/usage.py, which the pure-Python server uses). What it keeps is
//! the JSON text of the object that carries `usage`; Python reads it at the response's end.

pub const MAX_JSON_BYTES: usize = 4 * 1024 * 1024; // larger non-streamed bodies are not searched
const MAX_PARTIAL_LINE: usize = 65536;

pub struct UsageTracker {
    sse: bool,
    buf: Vec<u8>,
    partial: Vec<u8>,
    found: Option<Vec<u8>>,
}

impl UsageTracker {
    pub fn new(content_type: &str) -> Self {
        UsageTracker { sse: content_type.starts_with("text/event-stream"), buf: Vec::new(),
                       partial: Vec::new(), found: None }
    }

    pub fn feed(&mut self, chunk: &[u8]) {
        if chunk.is_empty() {
            return;
        }
        if !self.sse {
            if self.buf.len() + chunk.len() <= MAX_JSON_BYTES {
                self.buf.extend_from_slice(chunk);
            } else {
                self.buf = b"x".to_vec(); // too big: give up on this body
            }
            return;
        }
        let mut data = std::mem::take(&mut self.partial);
        data.extend_from_slice(chunk);
        let last = data.iter().rposition(|&b| b == b'\n');
        let rest = match last {
            Some(i) => {
                for line in data[..i].split(|&b| b == b'\n') {
                    self.line(line);
                }
                &data[i + 1..]
            }
            None => &data[..],
        };
        let keep = rest.len().saturating_sub(MAX_PARTIAL_LINE);
        self.partial = rest[keep..].to_vec();
    }

    fn line(&mut self, line: &[u8]) {
        let line = line.trim_ascii();
        if line.starts_with(b"data:") && contains(line, b"\"usage\"") {
            self.take(&line[5..]);
        }
    }

    fn take(&mut self, data: &[u8]) {
        if let Ok(serde_json::Value::Object(obj)) = serde_json::from_slice::<serde_json::Value>(data.trim_ascii()) {
            if matches!(obj.get("usage"), Some(serde_json::Value::Object(_))) {
                self.found = Some(data.trim_ascii().to_vec());
            }
        }
    }

    /// The JSON text of the last object that carried a `usage` object, if any.
    pub fn finish(&mut self) -> Option<Vec<u8>> {
        if self.sse {
            if !self.partial.is_empty() {
                let p = std::mem::take(&mut self.partial);
                self.line(&p);
            }
        } else if !self.buf.is_empty() && contains(&self.buf, b"\"usage\"") {
            let b = std::mem::take(&mut self.buf);
            self.take(&b);
        }
        self.found.take()
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_usage_across_chunk_boundaries() {
        let sse = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":11,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n";
        let mut t = UsageTracker::new("text/event-stream; charset=utf-8");
        for piece in [&sse[..40], &sse[40..70], &sse[70..]] {
            t.feed(piece);
        }
        let found = t.finish().expect("usage found");
        let v: serde_json::Value = serde_json::from_slice(&found).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 2);
    }

    #[test]
    fn json_body_and_its_limit() {
        let mut t = UsageTracker::new("application/json");
        t.feed(b"{\"choices\":[],\"usage\":{\"prompt_tokens\":7}}");
        assert!(t.finish().is_some());
        let mut big = UsageTracker::new("application/json");
        big.feed(&vec![b' '; MAX_JSON_BYTES]);
        big.feed(b"{\"usage\":{}}");
        assert!(big.finish().is_none());
    }

    #[test]
    fn a_later_broken_line_keeps_the_earlier_usage() {
        let mut t = UsageTracker::new("text/event-stream");
        t.feed(b"data: {\"usage\":{\"prompt_tokens\":1}}\ndata: {\"usage\": broken\n");
        let v: serde_json::Value = serde_json::from_slice(&t.finish().unwrap()).unwrap();
        assert_eq!(v["usage"]["prompt_tokens"], 1);
        let mut none = UsageTracker::new("text/event-stream");
        none.feed(b"data: {\"usage\": 5}\n");
        assert!(none.finish().is_none()); // usage must be an object
    }
}
