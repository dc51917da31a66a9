BEGIN TRANSACTION;
CREATE TABLE candidates (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  run_id TEXT NOT NULL,
  card_id TEXT NOT NULL,
  parent_id INTEGER,            -- MCTS parent (NULL: child of the root)
  repair_of INTEGER,            -- set when this is a repair attempt of a failed candidate
  iteration INTEGER NOT NULL,   -- search iteration that produced it
  created REAL NOT NULL,
  proposer TEXT NOT NULL,       -- builtin | llm:<model>
  kind TEXT NOT NULL,           -- custom | vendor
  digest TEXT NOT NULL,
  source TEXT NOT NULL,
  plan_json TEXT NOT NULL,
  knobs_json TEXT NOT NULL DEFAULT '{}',
  note TEXT NOT NULL DEFAULT '',
  verdict TEXT NOT NULL,
  message TEXT NOT NULL DEFAULT '',
  compile_log TEXT NOT NULL DEFAULT '',
  evidence_json TEXT NOT NULL DEFAULT '{}',
  eager_us REAL, kernel_us REAL, dispatched_us REAL, speedup REAL, reward REAL,
  max_abs_err REAL, max_rel_err REAL,
  flags_json TEXT NOT NULL DEFAULT '[]',
  eval_s REAL,
  compile_us REAL
);
INSERT INTO "candidates" VALUES(1,'r-today','3a711504b908f20c',NULL,NULL,0,1.79616758773841309546e+09,'fake','custom','39aedc9d839cc169e809','extern "C" __global__ void fake_kernel(const float* x, float* y) {
  // threads=256 vec=4 unroll=1
}
','{"kernels": [{"args": [{"in": 0}, {"out": 0}], "block": [256, 1, 1], "grid": [1024, 1, 1], "name": "fake_kernel", "smem": 0}], "options": [], "workspace": []}','{"threads": 256, "vec": 4, "unroll": 1}','','valid','','','{"phase_s": {"compile": 0.5}}',10.0,4.0,4.5,2.5,0.7,NULL,NULL,'[]',1.25,6.0);
INSERT INTO "candidates" VALUES(2,'r-today','3a711504b908f20c',1,NULL,1,1.79616758774997282025e+09,'fake','custom','a76699753ee9e79fbb29','extern "C" __global__ void fake_kernel(const float* x, float* y) {
  // threads=256 vec=4 unroll=8
}
','{"kernels": [{"args": [{"in": 0}, {"out": 0}], "block": [256, 1, 1], "grid": [1024, 1, 1], "name": "fake_kernel", "smem": 0}], "options": [], "workspace": []}','{"threads": 256, "vec": 4, "unroll": 8}','','compile_error','error: bad unroll','kernel.cu(3): error','{}',NULL,NULL,NULL,NULL,0.0,NULL,NULL,'[]',0.5,NULL);
INSERT INTO "candidates" VALUES(3,'r-today','3a711504b908f20c',1,2,1,1.79616758775126743319e+09,'fake','custom','e1081173c4cfb72447b2','extern "C" __global__ void fake_kernel(const float* x, float* y) {
  // threads=256 vec=4 unroll=2
}
','{"kernels": [{"args": [{"in": 0}, {"out": 0}], "block": [256, 1, 1], "grid": [1024, 1, 1], "name": "fake_kernel", "smem": 0}], "options": [], "workspace": []}','{"threads": 256, "vec": 4, "unroll": 2}','','slower','','','{}',10.0,12.5,NULL,0.8,0.45,NULL,NULL,'[]',0.75,NULL);
CREATE TABLE cards (
  run_id TEXT NOT NULL,
  card_id TEXT NOT NULL,
  op TEXT NOT NULL,
  family TEXT NOT NULL,
  summary TEXT NOT NULL,
  calls INTEGER, eager_us REAL, share REAL,
  status TEXT NOT NULL DEFAULT 'pending',   -- pending | searching | done | skipped | failed
  skip_reason TEXT,
  best_candidate INTEGER, best_speedup REAL,
  iterations INTEGER NOT NULL DEFAULT 0,
  floor_us REAL,
  card_json TEXT NOT NULL,
  PRIMARY KEY (run_id, card_id)
);
INSERT INTO "cards" VALUES('r-today','3a711504b908f20c','aten::relu.default','pointwise','relu.default(1048576:float32)',1,7.0,1.0,'done',NULL,1,2.5,2,1.5,'{"format": 2, "id": "3a711504b908f20c", "op": "aten::relu.default", "schema": "aten::relu.default(Tensor self) -> Tensor", "args": [{"name": "self", "kind": "tensor", "kwarg_only": false, "written": false, "tensor": {"shape": [1048576], "stride": [1], "dtype": "float32", "device": "cuda", "align": 16, "storage_offset": 0, "lo": null, "hi": null}}], "outputs": [{"shape": [1048576], "stride": [1], "dtype": "float32", "device": "cuda", "align": 16, "storage_offset": 0, "lo": null, "hi": null}], "aliases": {}, "arch": "sm_90", "family": "pointwise", "device_name": "", "calls": 1, "top_calls": null, "module_paths": [], "eager_us": 7.0, "total_us": 7.0, "share": 1.0, "samples": 0, "notes": []}');
CREATE TABLE events (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  run_id TEXT NOT NULL, card_id TEXT,
  created REAL NOT NULL,
  level TEXT NOT NULL,          -- info | warning | error
  kind TEXT NOT NULL,
  message TEXT NOT NULL
);
INSERT INTO "events" VALUES(1,'r-today','3a711504b908f20c',1.79616758775267267231e+09,'warning','proposer_error','propose failed: ProposerError: no kernel');
INSERT INTO "events" VALUES(2,'r-today','3a711504b908f20c',1.79616758776527428624e+09,'info','search_done','stopped (iterations) after 2 iterations');
CREATE TABLE llm_calls (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  run_id TEXT NOT NULL, card_id TEXT, candidate_id INTEGER,
  created REAL NOT NULL,
  model TEXT NOT NULL, base_url TEXT,
  prompt_tokens INTEGER, completion_tokens INTEGER, cost_usd REAL, duration_s REAL,
  status TEXT NOT NULL,         -- ok | error | retry
  error TEXT
);
INSERT INTO "llm_calls" VALUES(1,'r-today','3a711504b908f20c',NULL,1.79616758775220179559e+09,'gpt-x',NULL,100,20,0.01,1.0,'ok',NULL);
INSERT INTO "llm_calls" VALUES(2,'r-today','3a711504b908f20c',NULL,1.79616758775233507157e+09,'gpt-x',NULL,50,0,0.0,0.0,'error','timeout');
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO "meta" VALUES('schema_version','2');
CREATE TABLE runs (
  id TEXT PRIMARY KEY,
  created REAL NOT NULL,
  model TEXT,
  status TEXT NOT NULL DEFAULT 'running',   -- running | done | interrupted | failed
  device TEXT, arch TEXT, torch TEXT, kforge TEXT,
  config_json TEXT NOT NULL DEFAULT '{}'
);
INSERT INTO "runs" VALUES('r-today',1.79616758772067856789e+09,'Toy','done','NVIDIA H200','sm_90','2.x','0.x','{"iterations": 3, "validated": true, "out": null}');
CREATE INDEX candidates_card ON candidates (run_id, card_id, id);
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('candidates',3);
INSERT INTO "sqlite_sequence" VALUES('llm_calls',2);
INSERT INTO "sqlite_sequence" VALUES('events',2);
COMMIT;
