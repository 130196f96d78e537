"""Produces JSON orders for examples/kafka.toml.

    pip install kafka-python==3.0.12
    python3 examples/kafka_produce.py BROKER TOPIC COUNT [FIRST_ID]

Makes TOPIC with 3 partitions when it does not exist, then sends COUNT
orders {"id", "name", "amount"} with ids FIRST_ID.. (default 0), keyed by
id, and waits until the broker has acknowledged every one.
"""

import json
import sys

from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError


def main() -> None:
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    broker, topic, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    first = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    admin = KafkaAdminClient(bootstrap_servers=broker)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
    except TopicAlreadyExistsError:
        pass
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=broker, linger_ms=5)
    for i in range(first, first + count):
        value = {"id": i, "name": f"order-{i}", "amount": i * 0.25}
        producer.send(topic, key=f"k{i}".encode(), value=json.dumps(value).encode())
    producer.flush()
    producer.close()
    print(f"sent {count} orders to {topic} on {broker}")


if __name__ == "__main__":
    main()
