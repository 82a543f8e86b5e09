CREATE TABLE IF NOT EXISTS outboxkit_meta (
	table_name VARCHAR(64) NOT NULL, 
	shard_count INTEGER NOT NULL, 
	schema_version INTEGER NOT NULL, 
	created_at DATETIME(6) NOT NULL, 
	PRIMARY KEY (table_name)
);

CREATE TABLE IF NOT EXISTS outboxkit_recovery_events (
	id BIGINT NOT NULL AUTO_INCREMENT, 
	at DATETIME(6) NOT NULL, 
	kind VARCHAR(64) NOT NULL, 
	node_id VARCHAR(255) NOT NULL, 
	table_name VARCHAR(64) NOT NULL, 
	detail TEXT NOT NULL, 
	PRIMARY KEY (id)
)ENGINE=InnoDB CHARSET=utf8mb4;

CREATE TABLE IF NOT EXISTS outbox_events (
	id BIGINT NOT NULL AUTO_INCREMENT, 
	event_id VARCHAR(64) NOT NULL, 
	topic VARCHAR(249) NOT NULL, 
	message_key VARBINARY(512), 
	payload LONGBLOB NOT NULL, 
	headers TEXT, 
	shard SMALLINT NOT NULL, 
	status ENUM('pending','delivering','delivered','retryable','failed') NOT NULL, 
	attempts INTEGER NOT NULL DEFAULT '0', 
	next_attempt_at DATETIME(6) NOT NULL, 
	lease_owner VARCHAR(255), 
	lease_token VARCHAR(32), 
	lease_expires_at DATETIME(6), 
	last_error VARCHAR(1000), 
	created_at DATETIME(6) NOT NULL, 
	updated_at DATETIME(6) NOT NULL, 
	delivered_at DATETIME(6), 
	kafka_partition INTEGER, 
	kafka_offset BIGINT, 
	PRIMARY KEY (id), 
	CONSTRAINT uq_outbox_events_event_id UNIQUE (event_id)
)ENGINE=InnoDB CHARSET=utf8mb4;

CREATE INDEX IF NOT EXISTS ix_outbox_events_key_status ON outbox_events (message_key, status, id);

CREATE INDEX IF NOT EXISTS ix_outbox_events_status_id ON outbox_events (status, id);

CREATE TABLE IF NOT EXISTS outbox_inbox (
	group_id VARCHAR(255) NOT NULL, 
	event_id VARCHAR(255) NOT NULL, 
	topic VARCHAR(249), 
	kafka_partition INTEGER, 
	kafka_offset BIGINT, 
	processed_at DATETIME(6) NOT NULL, 
	PRIMARY KEY (group_id, event_id)
)ENGINE=InnoDB CHARSET=utf8mb4;
