"""The OpenAI Batch API on the node: files of requests fed through Envoy at the batch's priority.

Ports and adapters, like the rest of the sidecar:
- `lifecycle`: pure: a batch's statuses, how a line ends, its priority, ids, the documents' shapes;
- `validate`: pure: an input file read line by line into requests or errors naming each line;
- `lines`: pure: a file's lines read within a bound, a long line's fields found without building it;
- `store`: SQLite (WAL) and a directory of files: the one durable record of files, batches,
  their lines and each line's one result; `dirlock` keeps it to one sidecar;
- `rows`: the values of the store's rows (a batch, its counts, a line's result), shared by its readers;
- `output`: a batch's end: attempts counted, output files written by paging, results dropped;
- `feeder`: asyncio: sends each batch's lines to Envoy's public listener, a few at a time, and
  records what came back (`records`: a result's shape; `writer`: written together, kept while a
  full disk refuses them); resumes every batch after a restart;
- `http1`: the feeder's small keep-alive HTTP/1.1 client (its lines cost the sidecar's event loop
  less than a general client's);
- `api`: the HTTP routes (`/v1/files`, `/v1/batches`) on the admin server, which Envoy's listener
  routes there.
"""
