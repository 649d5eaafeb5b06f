-- The limits a lease grants (JSON of devlend_fabric::qos::Qos, flat form), signed into
-- its token; NULL: none.
ALTER TABLE leases ADD COLUMN qos TEXT;
