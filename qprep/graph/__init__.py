"""Float-graph work: preparing a loaded model, the verifier, and (one module per pass) the optimize rewrites."""
