"""gRPC servicers (proto <-> runtime types) and the admin HTTP server; no decisions here."""
