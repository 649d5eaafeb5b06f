-- Several paths to one lender (issue 36): a provider's fabric addresses beside
-- fabric_address, comma-separated in the order registered ('': none). A lease keeps
-- the paths its provider had when it was granted, as it keeps fabric_address.
ALTER TABLE providers ADD COLUMN fabric_paths TEXT NOT NULL DEFAULT '';
ALTER TABLE leases ADD COLUMN fabric_paths TEXT NOT NULL DEFAULT '';
