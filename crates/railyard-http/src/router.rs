//! A plain path and method table, callable without a socket.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use http::header::{HeaderValue, ALLOW, CONTENT_LENGTH};
use http::{Method, Request, Response, StatusCode};

use crate::body::{Body, RequestBody};
use crate::compress::{self, Encoding, FixedBody};

/// What a handler returns: a boxed future. It need not be `Send`: each
/// connection lives on one core's single-threaded runtime.
pub type HandlerFuture = Pin<Box<dyn Future<Output = Response<Body>>>>;

/// Something that answers requests. Implemented for every
/// `Fn(Request<RequestBody>) -> impl Future<Output = Response<Body>>`.
pub trait Handler: Send + Sync + 'static {
    /// Answers one request.
    fn call(&self, req: Request<RequestBody>) -> HandlerFuture;
}

impl<F, Fut> Handler for F
where
    F: Fn(Request<RequestBody>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + 'static,
{
    fn call(&self, req: Request<RequestBody>) -> HandlerFuture {
        Box::pin(self(req))
    }
}

#[derive(Clone)]
enum Endpoint {
    /// Answered without a future or an allocation beyond the response.
    Fixed(Arc<FixedBody>),
    Dynamic(Arc<dyn Handler>),
}

struct Route {
    id: usize,
    methods: Vec<(Method, Endpoint)>,
    allow: HeaderValue,
}

/// The route label of requests matching no route.
pub const UNMATCHED: &str = "unmatched";

/// Routes by exact path, then method. `GET` routes answer `HEAD` too.
///
/// Unknown paths get 404, known paths with another method 405 with `Allow`.
pub struct Router {
    routes: HashMap<String, Route, foldhash::fast::RandomState>,
    /// Route patterns by id; id 0 is [`UNMATCHED`].
    names: Vec<String>,
    compress_min_bytes: usize,
}

impl Default for Router {
    fn default() -> Self {
        Self::new()
    }
}

/// A routed request: its route id (see [`Router::route_names`]) and the
/// response, ready or to come.
pub struct Dispatch {
    /// Index into [`Router::route_names`].
    pub route: usize,
    /// The response.
    pub response: RouteFuture,
}

/// A response now, or a future one.
pub enum RouteFuture {
    /// Answered synchronously (fixed bodies, 404, 405).
    Ready(Response<Body>),
    /// A handler's future.
    Pending(HandlerFuture),
}

impl Router {
    /// An empty router (everything 404).
    pub fn new() -> Self {
        Self {
            routes: HashMap::default(),
            names: vec![UNMATCHED.to_owned()],
            compress_min_bytes: crate::HttpConfig::default().compress_min_bytes,
        }
    }

    /// Smallest dynamic body compressed on the fly.
    pub fn compress_min_bytes(mut self, n: usize) -> Self {
        self.compress_min_bytes = n;
        self
    }

    fn add(&mut self, method: Method, path: &str, ep: Endpoint) {
        assert!(path.starts_with('/'), "route paths start with '/': {path}");
        let next_id = self.names.len();
        let route = self.routes.entry(path.to_owned()).or_insert_with(|| Route {
            id: next_id,
            methods: vec![],
            allow: HeaderValue::from_static(""),
        });
        if route.id == next_id {
            self.names.push(path.to_owned());
        }
        route.methods.retain(|(m, _)| *m != method);
        route.methods.push((method, ep));
        let allow: Vec<&str> = route.methods.iter().map(|(m, _)| m.as_str()).collect();
        route.allow = HeaderValue::from_str(&allow.join(", ")).expect("method names are valid");
    }

    /// `GET path` answers `body` (compressed once per encoding).
    pub fn fixed(mut self, path: &str, body: FixedBody) -> Self {
        self.add(Method::GET, path, Endpoint::Fixed(Arc::new(body)));
        self
    }

    /// `method path` is answered by `handler`.
    pub fn route(mut self, method: Method, path: &str, handler: impl Handler) -> Self {
        self.add(method, path, Endpoint::Dynamic(Arc::new(handler)));
        self
    }

    /// `GET path` is answered by `handler`.
    pub fn get(self, path: &str, handler: impl Handler) -> Self {
        self.route(Method::GET, path, handler)
    }

    /// `POST path` is answered by `handler`.
    pub fn post(self, path: &str, handler: impl Handler) -> Self {
        self.route(Method::POST, path, handler)
    }

    /// Route patterns by id (id 0 is [`UNMATCHED`]), for metric labels.
    pub fn route_names(&self) -> &[String] {
        &self.names
    }

    /// Routes `req`; fixed bodies and errors are answered at once.
    pub fn dispatch(&self, req: Request<RequestBody>) -> Dispatch {
        let Some(route) = self.routes.get(req.uri().path()) else {
            return Dispatch {
                route: 0,
                response: RouteFuture::Ready(status(StatusCode::NOT_FOUND)),
            };
        };
        let method = if req.method() == Method::HEAD {
            &Method::GET
        } else {
            req.method()
        };
        let Some((_, ep)) = route.methods.iter().find(|(m, _)| m == method) else {
            let mut r = status(StatusCode::METHOD_NOT_ALLOWED);
            r.headers_mut().insert(ALLOW, route.allow.clone());
            return Dispatch {
                route: route.id,
                response: RouteFuture::Ready(r),
            };
        };
        let enc = Encoding::negotiate(req.headers());
        let response = match ep {
            Endpoint::Fixed(body) => RouteFuture::Ready(body.response(enc)),
            Endpoint::Dynamic(h) => {
                let fut = h.call(req);
                if enc == Encoding::Identity {
                    RouteFuture::Pending(fut)
                } else {
                    let min = self.compress_min_bytes;
                    RouteFuture::Pending(Box::pin(async move {
                        compress::on_the_fly(fut.await, enc, min).await
                    }))
                }
            }
        };
        Dispatch {
            route: route.id,
            response,
        }
    }

    /// The fixed body `GET path` answers, with its route id; `None` when
    /// that route is not a fixed one (or there is none). `path` excludes
    /// the query, as in [`Router::dispatch`].
    pub(crate) fn fixed_get(&self, path: &str) -> Option<(usize, &FixedBody)> {
        let route = self.routes.get(path)?;
        route.methods.iter().find_map(|(m, ep)| match ep {
            Endpoint::Fixed(body) if *m == Method::GET => Some((route.id, &**body)),
            _ => None,
        })
    }

    /// Answers `req` completely: what a connection would send, minus the
    /// transport. This is how tests call the app without a socket.
    pub async fn handle(&self, req: Request<RequestBody>) -> Response<Body> {
        let mut r = match self.dispatch(req).response {
            RouteFuture::Ready(r) => r,
            RouteFuture::Pending(f) => f.await,
        };
        body_length_wins(&mut r);
        r
    }
}

/// Makes a `Content-Length` header the handler set agree with its body, when
/// the body knows its exact length and is not empty: the body's length wins.
///
/// Why: for such a body hyper writes the handler's header as given but sends
/// the body's own length (only debug builds check, by panicking the
/// connection). A shorter header would leave the rest of the body on a
/// keep-alive connection, read by the client as the next response; a longer
/// one would make the client take the next response as the end of this one.
/// The body is what will actually be written (a file body's range is queued
/// whole for `sendfile`), so its length is the one that keeps the framing
/// right. Empty bodies are left alone: a `HEAD` answer's header describes the
/// `GET` body, and hyper sends no body bytes for them whatever the header
/// says. Bodies of unknown length are hyper's: it sends at most the header's
/// length and closes the connection if the body ends short.
pub(crate) fn body_length_wins(resp: &mut Response<Body>) {
    use http_body::Body as _;
    let body = resp.body();
    let Some(len) = body.size_hint().exact().filter(|_| !body.is_end_stream()) else {
        return;
    };
    let mut declared = resp.headers().get_all(CONTENT_LENGTH).iter();
    let Some(first) = declared.next() else {
        return;
    };
    let agrees = first
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        == Some(len);
    if agrees && declared.next().is_none() {
        return;
    }
    tracing::debug!(
        declared = ?first,
        body = len,
        "a handler's content-length disagrees with its body; sending the body's length"
    );
    resp.headers_mut()
        .insert(CONTENT_LENGTH, HeaderValue::from(len));
}

/// An empty response with `code`.
pub fn status(code: StatusCode) -> Response<Body> {
    let mut r = Response::new(Body::empty());
    *r.status_mut() = code;
    r
}

/// A short plain-text response with `code` (for client errors; never
/// internal details).
pub fn text(code: StatusCode, msg: &'static str) -> Response<Body> {
    let mut r = Response::new(Body::from(msg));
    *r.status_mut() = code;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(method: Method, path: &str) -> Request<RequestBody> {
        Request::builder()
            .method(method)
            .uri(path)
            .body(RequestBody::empty())
            .unwrap()
    }

    #[tokio::test]
    async fn routes_by_path_then_method() {
        let r = Router::new()
            .fixed("/a", FixedBody::new("aaa", "text/plain", 1024))
            .post("/b", |_req| async { text(StatusCode::CREATED, "made") });
        assert_eq!(r.route_names(), ["unmatched", "/a", "/b"]);
        let a = r.handle(req(Method::GET, "/a")).await;
        assert_eq!(a.status(), StatusCode::OK);
        assert_eq!(a.body().as_bytes().unwrap(), b"aaa");
        assert_eq!(r.handle(req(Method::HEAD, "/a")).await.status(), 200);
        assert_eq!(r.handle(req(Method::POST, "/b")).await.status(), 201);
        let wrong = r.handle(req(Method::GET, "/b")).await;
        assert_eq!(wrong.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(wrong.headers()[ALLOW], "POST");
        assert_eq!(r.handle(req(Method::GET, "/zzz")).await.status(), 404);
    }

    #[tokio::test]
    async fn a_body_of_known_length_overrides_the_handlers_content_length() {
        let with_length = |body: fn() -> Body, declared: &'static str| {
            move |_req| async move {
                let mut r = Response::new(body());
                r.headers_mut()
                    .insert(CONTENT_LENGTH, HeaderValue::from_static(declared));
                r
            }
        };
        let r = Router::new()
            .get("/short", with_length(|| Body::from("four"), "2"))
            .get("/long", with_length(|| Body::from("four"), "4000"))
            .get("/right", with_length(|| Body::from("four"), "4"))
            .get("/empty", with_length(Body::empty, "1234"));
        for path in ["/short", "/long", "/right"] {
            let resp = r.handle(req(Method::GET, path)).await;
            assert_eq!(resp.headers()[CONTENT_LENGTH], "4", "{path}");
        }
        // An empty body may announce another length (a `HEAD` answer's).
        let resp = r.handle(req(Method::HEAD, "/empty")).await;
        assert_eq!(resp.headers()[CONTENT_LENGTH], "1234");
    }
}
