"""HTTP API (FastAPI). Routes translate HTTP into calls on core/ and models/; nothing more."""
