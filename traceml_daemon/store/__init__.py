"""SQLite storage: schema, migrations, writer and read-only queries."""
