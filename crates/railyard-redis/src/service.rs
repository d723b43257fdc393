//! The seed-002 HTTP service (`GET /test`); see below.
